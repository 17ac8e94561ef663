"""PrefixRouting: one routing decision, the same in Serve's request router and in the simulation of
`bench route --simulate`: hash the prompt's whole pages as the prefix cache does, count the leading
pages each replica holds, note which replicas hold the request's LoRA adapter, and rank the replicas
by the policy.

Serve takes the least loaded replica of a group and the first of equals. One routing task may route
a burst of requests before any of them is sent (so before any load it knows of changes): each
decision starts the candidates one further along, so that a burst of equals spreads over them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from serve_app.kv.prefix_cache import PageHash, page_hashes
from serve_app.routing.adapter_holders import AdapterHolders
from serve_app.routing.policy import RoutingPolicy
from serve_app.routing.prefix_index import PrefixIndex


class PrefixRouting:
    def __init__(self, policy: RoutingPolicy, index: PrefixIndex | None = None) -> None:
        self.policy = policy
        self.index = index or PrefixIndex()
        self.adapters = AdapterHolders()
        self._decisions = 0

    def hashes(self, tokens: Sequence[int], prefix_salt: str) -> list[PageHash]:
        """The prompt's page hashes (none until the directory has said what a page is)."""
        if self.index.page_size is None:
            return []
        return list(page_hashes(tokens, self.index.page_size, prefix_salt))

    def rank(
        self,
        hashes: Sequence[PageHash],
        candidates: Iterable[str],
        loads: Mapping[str, int],
        adapter: str | None = None,
    ) -> list[list[str]]:
        """Groups of candidates, best first (the least loaded of a group takes the request)."""
        candidates = list(candidates)
        if candidates:
            self._decisions += 1
            start = self._decisions % len(candidates)
            candidates = candidates[start:] + candidates[:start]
        matched = self.index.matched_pages(hashes, candidates) if hashes else {}
        return self.policy.rank(candidates, loads, matched, len(hashes), self.adapters.of(adapter))

    def routed(self, replica: str, hashes: Sequence[PageHash], adapter: str | None = None) -> None:
        """A request with these pages (and this adapter) went to `replica`: hold them there until its events
        say so."""
        if hashes:
            self.index.note_routed(replica, hashes)
        if adapter:
            self.adapters.routed(adapter, replica)
