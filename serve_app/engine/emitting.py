"""TokenEmitter: a step's logits in, each sampled task's new tokens accepted and its output out (token ids).

A task samples one row, or, where it verified proposed tokens, one row per position: row j holds
the model's distribution after the task's tokens and the first j proposals. Positions run in
order, all tasks at once: at each, the rows are masked by their grammars (in the state the tokens
accepted so far left), sampled (a proposal by rejection sampling), and accepted one token per task,
with stop token ids, `max_tokens` and logprobs exactly as one token per step would. Where sampling the rows
together raises, each row is sampled alone on the same logits: a row that still raises ends its own task
with an error, and the forward is never run again. A task goes on to
the next position only while the model agreed with its proposal, so the tokens emitted are those
decoding one at a time would give (greedy: identical; sampled: the same distribution).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serve_app.engine.grammar import GrammarCompiler
from serve_app.engine.sampling import SamplingBatch, SamplingPipeline
from serve_app.engine.task import Task
from serve_app.wire.outputs import CoreOutput, SampledLogprob, merge_outputs

logger = logging.getLogger(__name__)

# What a client is told when its token could not be sampled (the exception is in the engine's log).
SAMPLING_FAILED = "sampling this request's next token failed (the engine's log says why)"


@dataclass(frozen=True)
class Emitted:
    """One task's outcome of a step: its new tokens as one output (ending it, if it has a finish reason),
    and how many of its proposals it accepted."""

    output: CoreOutput
    accepted: int


class TokenEmitter:
    def __init__(self, grammars: GrammarCompiler, max_model_len: int) -> None:
        self.grammars = grammars
        self.max_model_len = max_model_len
        self.sampler = SamplingPipeline()

    def emit(self, logits: torch.Tensor, tasks: Sequence[Task], first_rows: Sequence[int]) -> list[Emitted]:
        """`logits` [rows, vocab]; task i's rows start at `first_rows[i]`, one more than its `drafts`."""
        outputs: list[list[CoreOutput]] = [[] for _ in tasks]
        accepted = [0] * len(tasks)
        live = list(range(len(tasks)))
        position = 0
        while live:
            group = [tasks[i] for i in live]
            index = [first_rows[i] + position for i in live]
            # Without proposals the rows are the logits as they are: no copy of [rows, vocab].
            rows = logits if index == list(range(logits.shape[0])) else logits[torch.tensor(index, device=logits.device)]
            drafts = [t.drafts[position] if position < len(t.drafts) else None for t in group]
            tokens, errors = self._sample_isolated(rows, group, drafts)
            logprobs = self._logprobs(rows, tokens, group)
            going_on = []
            for i, task, token, logprob, draft, error in zip(live, group, tokens.tolist(), logprobs, drafts, errors):
                if error is not None:
                    outputs[i].append(CoreOutput((), (), "error", error=SAMPLING_FAILED))
                    continue
                output = task.accept(int(token), self.max_model_len, logprob)
                outputs[i].append(output)
                agreed = draft is not None and token == draft
                accepted[i] += agreed
                if agreed and output.finish_reason is None:
                    going_on.append(i)
            live, position = going_on, position + 1
        return [Emitted(merge_outputs(o), a) for o, a in zip(outputs, accepted)]

    def _sample_isolated(
        self, rows: torch.Tensor, tasks: list[Task], drafts: list[int | None]
    ) -> tuple[torch.Tensor, list[str | None]]:
        """Each row's token, and for each row the error that kept it from one (None where it has one), logged."""
        try:
            return self._sample(rows, tasks, drafts), [None] * len(tasks)
        except Exception as error:  # one row's parameters or grammar: find it, and let the others go on
            logger.warning("sampling %d rows together failed (%s); sampling each alone", len(tasks), error)
        tokens = torch.zeros(len(tasks), dtype=torch.long, device=rows.device)
        errors: list[str | None] = [None] * len(tasks)
        for row, (task, draft) in enumerate(zip(tasks, drafts)):
            try:
                tokens[row] = self._sample(rows[row : row + 1], [task], [draft])[0]
            except Exception as error:
                logger.exception("task %d: sampling failed", task.task_id)
                errors[row] = str(error) or type(error).__name__
        return tokens, errors

    def _sample(self, rows: torch.Tensor, tasks: list[Task], drafts: list[int | None]) -> torch.Tensor:
        batch = SamplingBatch.build(
            [t.sampling.params for t in tasks],
            rows.device,
            generators=[t.sampling.generator for t in tasks],
            prompt_ids=[t.tokens[: t.prompt_len] if t.sampling.params.has_penalties else () for t in tasks],
            output_ids=[t.output_ids if t.sampling.params.has_penalties else () for t in tasks],
            banned=[t.banned_token_ids for t in tasks],
        )
        matchers = [t.active_matcher for t in tasks]
        forced = [t.forced_token for t in tasks]
        if any(m is not None for m in matchers):
            rows = self.grammars.mask(rows, matchers, forced)
        unconstrained = {row: token for row, (token, m) in enumerate(zip(forced, matchers)) if token is not None and m is None}
        if unconstrained:
            rows = _only(rows, unconstrained)
        return self.sampler(rows, batch, drafts if any(d is not None for d in drafts) else None)

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, tasks: list[Task]) -> list[SampledLogprob | None]:
        """The model's log-probabilities (before any sampling transform) for tasks that asked for them."""
        rows = [i for i, t in enumerate(tasks) if t.sampling.logprobs is not None]
        out: list[SampledLogprob | None] = [None] * len(tasks)
        if not rows:
            return out
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        log_probs = torch.log_softmax(logits[index], dim=-1)
        chosen = log_probs.gather(1, tokens[index][:, None])[:, 0].tolist()
        top_k = max(tasks[i].sampling.logprobs or 0 for i in rows)
        top_values, top_ids = log_probs.topk(top_k, dim=-1) if top_k else (None, None)
        for j, i in enumerate(rows):
            token = int(tokens[i])
            count = tasks[i].sampling.logprobs or 0
            top = ()
            if count:
                ids, values = top_ids[j, :count].tolist(), top_values[j, :count].tolist()
                top = tuple(zip(ids, values))
            out[i] = SampledLogprob(token, chosen[j], top)
        return out


def _only(logits: torch.Tensor, tokens: dict[int, int]) -> torch.Tensor:
    """`logits` (a copy) where each row of `tokens` allows only its token (a thinking span closed by its budget)."""
    masked = logits.clone()
    for row, token in tokens.items():
        kept = masked[row, token].clone()
        masked[row] = float("-inf")
        masked[row, token] = kept
    return masked
