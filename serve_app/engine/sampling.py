"""Sampling: the strategies, and the pipeline that turns logits into tokens with each row's `SamplingParams`.

The pipeline runs penalties -> logit bias (with allowed and banned tokens) -> temperature -> top-k -> top-p -> min-p -> softmax -> multinomial
on a batch of rows (one per sequence), each row with its own parameters. Rows with
temperature 0 take the argmax of their (penalised) logits. Any value the request types allow stays finite
or masked: a penalty's overflow is the largest float, temperature divides logits already shifted to a
maximum of 0 (so a tiny temperature gives the top token, never NaN), and a row whose probabilities are not
a distribution takes its argmax. A sampled row that carries a proposed
token (speculative decoding) draws by rejection sampling against it, which keeps the row's
distribution exactly: the proposal with its probability, else a draw from the rest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serve_app.wire.requests import SamplingParams

_NEG_INF = float("-inf")
# top_k as a tensor holds int64; a larger value keeps every token anyway.
_MAX_TOP_K = 2**31 - 1


@dataclass
class SamplingBatch:
    """Per-row parameters as tensors, plus what penalties and seeded rows need."""

    params: Sequence[SamplingParams]
    generators: Sequence[torch.Generator | None]
    prompt_ids: Sequence[Sequence[int]]
    output_ids: Sequence[Sequence[int]]
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    banned: Sequence[frozenset[int]]  # per row, tokens it may not take now (a stop token before min_tokens)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        device: torch.device,
        generators: Sequence[torch.Generator | None] | None = None,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        output_ids: Sequence[Sequence[int]] | None = None,
        banned: Sequence[frozenset[int]] | None = None,
    ) -> SamplingBatch:
        rows = len(params)
        return cls(
            params=params,
            generators=generators if generators is not None else [None] * rows,
            prompt_ids=prompt_ids if prompt_ids is not None else [()] * rows,
            output_ids=output_ids if output_ids is not None else [()] * rows,
            temperature=torch.tensor([p.temperature or 1.0 for p in params], device=device),
            top_k=torch.tensor([min(p.top_k, _MAX_TOP_K) if p.top_k > 0 else 0 for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            min_p=torch.tensor([p.min_p for p in params], device=device),
            banned=banned if banned is not None else [frozenset()] * rows,
        )

    def rows(self, index: Sequence[int]) -> SamplingBatch:
        """The batch of rows `index` only."""
        at = torch.tensor(list(index), dtype=torch.long, device=self.temperature.device)
        return SamplingBatch(
            params=[self.params[r] for r in index],
            generators=[self.generators[r] for r in index],
            prompt_ids=[self.prompt_ids[r] for r in index],
            output_ids=[self.output_ids[r] for r in index],
            temperature=self.temperature[at],
            top_k=self.top_k[at],
            top_p=self.top_p[at],
            min_p=self.min_p[at],
            banned=[self.banned[r] for r in index],
        )


class BaseSamplingStrategy(ABC):
    """One transformation of a batch of logits [rows, vocab]; masked entries become -inf."""

    @abstractmethod
    def applies(self, batch: SamplingBatch) -> bool:
        """Whether any row needs this strategy (so the pipeline can skip it)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor: ...


class PenaltyStrategy(BaseSamplingStrategy):
    """Repetition penalty over prompt and output (as transformers does); presence and frequency over output."""

    def applies(self, batch: SamplingBatch) -> bool:
        return any(p.has_penalties for p in batch.params)

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = logits.clone()
        for row, params in enumerate(batch.params):
            if not params.has_penalties:
                continue
            if params.repetition_penalty != 1.0:
                seen = torch.tensor(sorted({*batch.prompt_ids[row], *batch.output_ids[row]}), dtype=torch.long)
                if seen.numel():
                    seen = seen.to(logits.device)
                    values = logits[row, seen]
                    penalty = params.repetition_penalty
                    logits[row, seen] = torch.where(values > 0, values / penalty, values * penalty)
            if (params.presence_penalty or params.frequency_penalty) and batch.output_ids[row]:
                counts = torch.bincount(
                    torch.tensor(batch.output_ids[row], dtype=torch.long), minlength=logits.shape[1]
                ).to(logits.device, logits.dtype)
                logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
        # A penalty near 0 divides a positive logit into +inf: keep it the largest finite value instead.
        return logits.masked_fill(logits == float("inf"), torch.finfo(logits.dtype).max)


class LogitBiasStrategy(BaseSamplingStrategy):
    """Each row's `logit_bias` added to its logits; tokens outside its `allowed_token_ids`, and those it may not
    take yet (`banned`), masked. Greedy rows too: it runs before the argmax."""

    def applies(self, batch: SamplingBatch) -> bool:
        return any(p.has_bias for p in batch.params) or any(batch.banned)

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = logits.clone()
        device = logits.device
        for row, (params, banned) in enumerate(zip(batch.params, batch.banned)):
            if params.allowed_token_ids is not None:
                allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=device)
                kept = logits[row, allowed]
                logits[row] = _NEG_INF
                logits[row, allowed] = kept
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
                logits[row, ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=device)
            if banned:
                logits[row, torch.tensor(sorted(banned), dtype=torch.long, device=device)] = _NEG_INF
        return logits


class TemperatureStrategy(BaseSamplingStrategy):
    def applies(self, batch: SamplingBatch) -> bool:
        return bool((batch.temperature != 1.0).any())

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Logits shifted so each row's top is 0 (softmax and every later strategy are unchanged by it), then
        divided: the top stays 0 and the rest at most -0, however small the temperature."""
        top = logits.max(dim=1, keepdim=True).values
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a fully masked row stays as it is
        return (logits - top) / batch.temperature[:, None]


class TopKStrategy(BaseSamplingStrategy):
    """Keep each row's `top_k` largest logits (0 keeps all)."""

    def applies(self, batch: SamplingBatch) -> bool:
        return bool((batch.top_k > 0).any())

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        vocab = logits.shape[1]
        k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=vocab), torch.full_like(batch.top_k, vocab))
        top = torch.topk(logits, int(k.max()), dim=1).values
        threshold = top.gather(1, (k - 1)[:, None])
        return logits.masked_fill(logits < threshold, _NEG_INF)


class TopPStrategy(BaseSamplingStrategy):
    """Keep the smallest set of tokens whose probability reaches `top_p` (the top token always stays)."""

    def applies(self, batch: SamplingBatch) -> bool:
        return bool((batch.top_p < 1.0).any())

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        sorted_logits, order = torch.sort(logits, dim=1, descending=True)
        probs = sorted_logits.softmax(dim=1)
        mass_before = probs.cumsum(dim=1) - probs
        drop_sorted = mass_before >= batch.top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        return logits.masked_fill(drop, _NEG_INF)


class MinPStrategy(BaseSamplingStrategy):
    """Drop tokens whose probability is under `min_p` times the top token's."""

    def applies(self, batch: SamplingBatch) -> bool:
        return bool((batch.min_p > 0.0).any())

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs = logits.softmax(dim=1)
        threshold = probs.max(dim=1, keepdim=True).values * batch.min_p[:, None]
        return logits.masked_fill(probs < threshold, _NEG_INF)


class SamplingPipeline:
    """Strategies in order, then softmax and a multinomial draw (seeded rows use their own generator)."""

    def __init__(self, strategies: Sequence[BaseSamplingStrategy] | None = None) -> None:
        self.penalties = PenaltyStrategy()
        self.bias = LogitBiasStrategy()
        self.strategies = list(strategies) if strategies is not None else [
            TemperatureStrategy(),
            TopKStrategy(),
            TopPStrategy(),
            MinPStrategy(),
        ]

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, drafts: Sequence[int | None] | None = None
    ) -> torch.Tensor:
        """Token ids [rows] for logits [rows, vocab]; a row's `drafts` entry, where not None, is the token
        proposed for it (the row's token equals it exactly when the proposal is accepted)."""
        for strategy in (self.penalties, self.bias):  # greedy rows' too
            if strategy.applies(batch):
                logits = strategy.apply(logits, batch)
        tokens = logits.argmax(dim=1)
        sampled = [row for row, p in enumerate(batch.params) if not p.is_greedy]
        if not sampled:
            return tokens
        index = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        sub = batch.rows(sampled)
        rows = logits[index]
        for strategy in self.strategies:
            if strategy.applies(sub):
                rows = strategy.apply(rows, sub)
        sub_drafts = [drafts[r] for r in sampled] if drafts is not None else [None] * len(sampled)
        probs = rows.softmax(dim=1)
        usable = torch.isfinite(probs).all(dim=1) & (probs.sum(dim=1) > 0)
        if not bool(usable.all()):  # no distribution left to draw from: the row's best token
            probs = torch.where(usable[:, None], probs, torch.nn.functional.one_hot(tokens[index], probs.shape[1]).to(probs.dtype))
        tokens[index] = self._draw(probs, sub.generators, sub_drafts)
        return tokens

    @staticmethod
    def _draw(
        probs: torch.Tensor, generators: Sequence[torch.Generator | None], drafts: Sequence[int | None]
    ) -> torch.Tensor:
        out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        shared = [row for row, g in enumerate(generators) if g is None and drafts[row] is None]
        if shared:
            out[shared] = torch.multinomial(probs[shared], 1)[:, 0]
        for row, (generator, draft) in enumerate(zip(generators, drafts)):
            if draft is not None:
                out[row] = verify_draft(probs[row], draft, generator)
            elif generator is not None:
                out[row] = torch.multinomial(probs[row], 1, generator=generator)[0]
        return out


def verify_draft(probs: torch.Tensor, draft: int, generator: torch.Generator | None = None) -> int:
    """Rejection sampling of a proposed token against `probs` [vocab], the proposal having come with
    certainty (n-gram lookup): accept it with probability p(draft), else draw from p without it,
    renormalised. The token returned is distributed exactly as `probs`."""
    accept = probs[draft]
    if float(torch.rand((), generator=generator, device=probs.device)) < float(accept):
        return draft
    residual = probs.clone()
    residual[draft] = 0.0
    return int(torch.multinomial(residual, 1, generator=generator)[0])


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 50,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample token ids from logits [vocab] or [rows, vocab] with one set of parameters."""
    single = logits.dim() == 1
    rows = logits[None] if single else logits
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    batch = SamplingBatch.build([params] * rows.shape[0], rows.device, generators=[generator] * rows.shape[0])
    tokens = SamplingPipeline()(rows, batch)
    return tokens[0] if single else tokens
