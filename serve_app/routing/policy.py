"""RoutingPolicy: rank replicas for one request. Load first: when queues are imbalanced past both
thresholds (SGLang's router uses the same pair), any replica will do and the least loaded wins;
otherwise the replicas holding the longest run of the prompt's pages come first, when that run is at
least `min_match_ratio` of the prompt's pages (a shared system prompt alone does not pull every
request to one replica; SGLang's `cache_threshold` does the same)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
        self, candidates: Sequence[str], loads: Mapping[str, int], matched: Mapping[str, int], pages: int
    ) -> list[list[str]]:
        """Groups of replicas, best first, for a prompt of `pages` whole pages of which each candidate holds
        `matched` leading ones; within a group the least loaded is taken (Serve does that)."""
        if not candidates:
            return []
        if self.imbalanced([loads.get(c, 0) for c in candidates]):
            return [sorted(candidates, key=lambda c: loads.get(c, 0))]
        best = max(matched.get(c, 0) for c in candidates)
        if best == 0 or best < self.min_match_ratio * pages:
            return [list(candidates)]
        first = [c for c in candidates if matched.get(c, 0) == best]
        rest = [c for c in candidates if matched.get(c, 0) < best]
        return [first, rest] if rest else [first]
