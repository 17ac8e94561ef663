"""PageSource and PageStore: what a tier offers the engine: how far a run of keys is held, read that run,
and (a store) write pages."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from serve_app.kv.tiers.pages import PageKey


@dataclass(frozen=True)
class StoreUsage:
    """What a tier holds and has let go: bytes and pages now, pages evicted, corrupt pages found."""

    bytes: int = 0
    pages: int = 0
    evictions: int = 0
    corrupt: int = 0


class PageSource(ABC):
    """One tier to read from. Methods block (disk reads, Ray calls): the engine calls them from its tier
    threads only."""

    name: str

    @abstractmethod
    def held(self, keys: Sequence[PageKey]) -> int:
        """How many leading keys of `keys` this tier holds."""

    @abstractmethod
    def read(self, keys: Sequence[PageKey]) -> list[np.ndarray]:
        """The pages of the leading run of `keys` this tier holds and can read intact (writable arrays)."""

    @abstractmethod
    def usage(self) -> StoreUsage:
        """What it holds now."""


class PageStore(PageSource):
    """A tier the engine also writes its pages to."""

    @abstractmethod
    def write(self, keys: Sequence[PageKey], pages: Sequence[np.ndarray]) -> None:
        """Keep these pages (those already held are only touched); the least recently used make room."""
