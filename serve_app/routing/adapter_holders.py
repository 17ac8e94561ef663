"""AdapterHolders: which replicas a request router has sent each LoRA adapter's requests to. They hold it
loaded, unless it has since been unloaded to make room for others: then preferring them costs one reload."""

from __future__ import annotations

from collections import OrderedDict

# Adapters remembered at most; the least recently routed are forgotten first.
MAX_ADAPTERS = 4096


class AdapterHolders:
    def __init__(self, max_adapters: int = MAX_ADAPTERS) -> None:
        self._holders: OrderedDict[str, set[str]] = OrderedDict()
        self._max = max_adapters

    def routed(self, adapter: str, replica: str) -> None:
        self._holders.setdefault(adapter, set()).add(replica)
        self._holders.move_to_end(adapter)
        while len(self._holders) > self._max:
            self._holders.popitem(last=False)

    def of(self, adapter: str | None) -> frozenset[str]:
        return frozenset(self._holders.get(adapter, ())) if adapter else frozenset()

    def __len__(self) -> int:
        return len(self._holders)
