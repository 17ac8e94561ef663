"""Speculative decoding's proposing side: n-gram prompt lookup per task, how many of the tokens found
are worth verifying, and the counts.

A decode row with proposals runs its last token and the proposed ones in one forward (each as a
decode row of the paged attention); the sampler then keeps the proposals the model agrees with
(`serve_app.engine.emitting`). Proposing is model-free: the tokens that followed the latest earlier
occurrence of the task's last n tokens, in its prompt or its output, for the longest n that occurs.

Proposals are not free: each adds a token to the step, and a step's time is not a line in its
tokens (on the CPU, 1 row runs as a matrix-vector product, a few as a small matrix product). So a
step keeps the proposals that maximise its expected tokens per second: B decode rows plus each kept
proposal's chance of acceptance, over the step's time at B plus the kept proposals' tokens
(`StepTimes`, measured on the steps that ran). A task's chance per proposed token comes from its own
outcomes (`TaskSpeculation.acceptance`; the j-th proposal is accepted only with all before it). A
task that copies its input keeps several proposals, one that writes freely keeps none, and a full
batch keeps only near-certain ones: under load it backs off by itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from serve_app.config import SpeculativeConfig

PRIOR_ACCEPTANCE = 0.6  # a task's chance per proposed token before it has any outcome
OUTCOME_DECAY = 0.8  # a task's older outcomes count this much less at each new one
IDLE_DECAY = 0.95  # per step without proposals, a task's outcomes fade toward the prior (so it tries again)
STEP_TIME_WEIGHT = 0.1  # a new step's share of the running mean time of steps of its size (after its first 10)
REMEASURE_AFTER = 500  # decode steps after which a size's time is forgotten unless a step of its size ran again
UNSEEN_TOKEN_SHARE = 0.1  # a step size not seen yet: each token past the largest seen costs this share of its time


class NgramIndex:
    """Where each n-gram of a growing token list last ended, for n in [min_n, max_n]."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._last_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed = 0  # the n-grams ending before this index are in

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
        (of min_n to max_n tokens) seen before; [] when none was."""
        last = len(tokens) - 1
        for end in range(self._indexed, last):  # every n-gram but the suffix itself
            for n, table in self._last_end.items():
                if end + 1 >= n:
                    table[tuple(tokens[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, last)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = self._last_end[n].get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return list(tokens[end + 1 : end + 1 + limit])
        return []


@dataclass
class TaskSpeculation:
    """One task's n-grams and how its proposals fared: decayed counts of accepted proposals and of
    rejections, whose ratio (from a prior) is its chance that a proposed token is accepted."""

    index: NgramIndex
    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def acceptance(self) -> float:
        return (self.accepted + 2 * PRIOR_ACCEPTANCE) / (self.accepted + self.rejected + 2)

    def record(self, proposed: int, accepted: int) -> None:
        self.accepted = self.accepted * OUTCOME_DECAY + accepted
        self.rejected = self.rejected * OUTCOME_DECAY + (accepted < proposed)

    def idle(self) -> None:
        self.accepted *= IDLE_DECAY
        self.rejected *= IDLE_DECAY


@dataclass
class _SizeTime:
    """The measured time of decode steps of one token count: its mean, over how many, and the last step."""

    mean: float
    count: int = 0
    last_step: int = 0


class StepTimes:
    """The mean time of recent decode steps by their token count; a count not seen yet is interpolated
    between its nearest seen neighbours, or, past the largest seen, estimated optimistically (so that a
    size is tried, and then known).

    A size's first steps are averaged alike, later ones by a running mean. A size not run for
    `REMEASURE_AFTER` steps is forgotten: a size that measured slow once (a first run's one-time costs,
    a moment the host was busy) is not kept from being tried, and so measured again, for good.
    """

    def __init__(self) -> None:
        self._sizes: dict[int, _SizeTime] = {}
        self._steps = 0

    def record(self, tokens: int, seconds: float) -> None:
        self._steps += 1
        size = self._sizes.setdefault(tokens, _SizeTime(seconds))
        size.count += 1
        size.mean += max(1 / size.count, STEP_TIME_WEIGHT) * (seconds - size.mean)
        size.last_step = self._steps
        for stale in [n for n, known in self._sizes.items() if self._steps - known.last_step >= REMEASURE_AFTER]:
            del self._sizes[stale]

    def estimate(self, tokens: int) -> float | None:
        """Seconds a decode step of `tokens` takes; None before any step of its size or smaller ran."""
        if tokens in self._sizes:
            return self._sizes[tokens].mean
        below = max((n for n in self._sizes if n < tokens), default=None)
        if below is None:
            return None
        above = min((n for n in self._sizes if n > tokens), default=None)
        if above is None:
            return self._sizes[below].mean * (1 + UNSEEN_TOKEN_SHARE * (tokens - below) / below)
        share = (tokens - below) / (above - below)
        return self._sizes[below].mean + share * (self._sizes[above].mean - self._sizes[below].mean)


@dataclass
class SpeculationStats:
    """Counts since start: decode rows verified with proposals, tokens proposed, proposals accepted, tokens
    those rows emitted (accepted ones plus the model's own next token), and decode rows that proposed
    nothing though some were found, as none paid at their step's size (or it was over `disable_by_batch_size`)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    backed_off_rows: int = 0


class Speculator:
    """Proposes tokens for decode rows (`speculative_config`), keeps those that pay, and counts how they fared."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpeculationStats()
        self.step_times = StepTimes()

    def proposes_at(self, num_decodes: int) -> bool:
        """Whether a step of `num_decodes` decode rows may propose (not above `disable_by_batch_size`)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_decodes > limit:
            self.stats.backed_off_rows += num_decodes
            return False
        return True

    def find(self, state: TaskSpeculation | None, tokens: Sequence[int], limit: int) -> tuple[TaskSpeculation, list[int]]:
        """The task's state (made on first use) and up to `min(limit, num_speculative_tokens)` tokens found to
        propose after `tokens`."""
        if state is None:
            state = TaskSpeculation(NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max))
        limit = min(limit, self.config.num_speculative_tokens)
        return state, state.index.propose(tokens, limit) if limit > 0 else []

    def keep(self, num_decodes: int, found: Sequence[tuple[TaskSpeculation, int]], spare: int) -> list[int]:
        """How many of each row's found proposals (`(state, count)` per row) the step of `num_decodes` decode
        rows verifies, at most `spare` in all: the leading ones of each row that give the step the most
        expected tokens per second. A row that had some found and keeps none has backed off."""
        chances = sorted(
            ((state.acceptance ** (j + 1), row) for row, (state, count) in enumerate(found) for j in range(count)),
            reverse=True,
        )[:spare]
        base = self.step_times.estimate(num_decodes)
        best, best_rate, expected = 0, 0.0, float(num_decodes)
        for added, (chance, _) in enumerate(chances, start=1):
            expected += chance
            time = self.step_times.estimate(num_decodes + added)
            if base is None or time is None:
                best = added  # nothing measured yet: verify them all, and learn
                continue
            rate = expected / time
            if rate > max(best_rate, num_decodes / base):
                best, best_rate = added, rate
        kept = [0] * len(found)
        for _, row in chances[:best]:
            kept[row] += 1
        self.stats.backed_off_rows += sum(1 for (_, count), k in zip(found, kept) if count and not k)
        for (state, _), k in zip(found, kept):
            if not k:
                state.idle()
        return kept

    def record(self, state: TaskSpeculation, proposed: int, accepted: int, emitted: int) -> None:
        """One verified row's outcome."""
        state.record(proposed, accepted)
        self.stats.drafts += 1
        self.stats.draft_tokens += proposed
        self.stats.accepted_tokens += accepted
        self.stats.emitted_tokens += emitted
