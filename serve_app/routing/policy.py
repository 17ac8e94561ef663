"""RoutingPolicy: rank replicas for one request. Load first: when queues are imbalanced past both
thresholds (SGLang's router uses the same pair), the replicas far above the least loaded are tried
last. Among the others, the replicas holding the longest run of the prompt's pages come first, when
that run is at least `min_match_ratio` of the prompt's pages (a shared system prompt alone does not
pull every request to one replica; SGLang's `cache_threshold` does the same). Without such a run, the
replicas that hold the request's LoRA adapter come first, so an adapter is not loaded on every replica."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingPolicy:
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5
    min_match_ratio: float = 0.5

    def imbalanced(self, loads: Sequence[int]) -> bool:
        if len(loads) < 2:
            return False
        most, least = max(loads), min(loads)
        return most - least > self.balance_abs_threshold and most > self.balance_rel_threshold * least

    def rank(
        self,
        candidates: Sequence[str],
        loads: Mapping[str, int],
        matched: Mapping[str, int],
        pages: int,
        holders: Collection[str] = (),
    ) -> list[list[str]]:
        """Groups of replicas, best first, for a prompt of `pages` whole pages of which each candidate holds
        `matched` leading ones, and whose adapter `holders` hold; within a group the least loaded is taken
        (Serve does that). When loads are imbalanced, the replicas more than `balance_abs_threshold` above
        the least loaded come last, and the prefix (else the adapter) decides among the others."""
        if not candidates:
            return []
        eligible, overloaded = list(candidates), []
        if self.imbalanced([loads.get(c, 0) for c in candidates]):
            least = min(loads.get(c, 0) for c in candidates)
            eligible = [c for c in candidates if loads.get(c, 0) - least <= self.balance_abs_threshold]
            overloaded = sorted((c for c in candidates if c not in eligible), key=lambda c: loads.get(c, 0))
        return self._by_prefix(eligible, matched, pages, holders) + ([overloaded] if overloaded else [])

    def _by_prefix(
        self, candidates: list[str], matched: Mapping[str, int], pages: int, holders: Collection[str]
    ) -> list[list[str]]:
        best = max(matched.get(c, 0) for c in candidates)
        if best == 0 or best < self.min_match_ratio * pages:
            return _first_those(candidates, lambda c: c in holders)
        return _first_those(candidates, lambda c: matched.get(c, 0) == best)


def _first_those(candidates: list[str], chosen: Callable[[str], bool]) -> list[list[str]]:
    """The `chosen` candidates as a group before the rest (one group when either is empty)."""
    first = [c for c in candidates if chosen(c)]
    rest = [c for c in candidates if not chosen(c)]
    return [first, rest] if first and rest else [candidates]
