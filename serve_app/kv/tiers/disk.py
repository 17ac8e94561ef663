"""DiskStore: the disk tier, one file per page under `disk_path`, bounded by `disk_bytes`.

A file is a header (magic, payload length, CRC-32 of the payload) and the page's bytes, written to a
temporary name and renamed into place, so a reader never sees half a file. The folders are the server's
own (0700) and so are the files (0600): they hold every tenant's KV. A file whose header, length (the
page size of this layout), or checksum is wrong is deleted, counted as corrupt and read as a miss: the
engine recomputes those tokens. Files another
engine wrote under the same folder are read too; the bound counts what this engine holds (the files it
wrote, and those it found at start), least recently used out.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from serve_app.kv.tiers.pages import PageKey
from serve_app.kv.tiers.store import PageStore, StoreUsage

logger = logging.getLogger(__name__)

_MAGIC = b"SAKV1\x00"
_HEADER = struct.Struct(f"<{len(_MAGIC)}sQI")  # magic, payload length, crc32 of the payload
_SUFFIX = ".kvpage"
_PRIVATE_FOLDER = 0o700
_PRIVATE_FILE = 0o600


class DiskStore(PageStore):
    name = "disk"

    def __init__(self, folder: Path, capacity_bytes: int, page_bytes: int | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True, mode=_PRIVATE_FOLDER)
        os.chmod(self.folder, _PRIVATE_FOLDER)  # a folder made before, or by a umask that opened it
        self.capacity = capacity_bytes
        self.page_bytes = page_bytes  # every page's payload size, where known
        self._sizes: OrderedDict[PageKey, int] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._evictions = 0
        self._corrupt = 0
        self._lock = threading.Lock()
        self._adopt_existing()

    def path_of(self, key: PageKey) -> Path:
        name = key.hex()
        return self.folder / name[-2:] / f"{name}{_SUFFIX}"

    def _adopt_existing(self) -> None:
        """Count the files a previous engine left here, oldest first, so the bound covers them (and make them the
        server's own, as this engine writes them)."""
        found = []
        for folder in self.folder.glob("*/"):
            os.chmod(folder, _PRIVATE_FOLDER)
        for path in self.folder.glob(f"*/*{_SUFFIX}"):
            try:
                os.chmod(path, _PRIVATE_FILE)
                stat = path.stat()
                found.append((stat.st_mtime, bytes.fromhex(path.name.removesuffix(_SUFFIX)), stat.st_size))
            except (OSError, ValueError):
                continue
        for _, key, size in sorted(found):
            self._sizes[key] = size
            self._bytes += size
        self._evict()

    def held(self, keys: Sequence[PageKey]) -> int:
        count = 0
        for key in keys:
            if key not in self._sizes and not self.path_of(key).exists():
                break
            count += 1
        return count

    def read(self, keys: Sequence[PageKey]) -> list[np.ndarray]:
        pages: list[np.ndarray] = []
        for key in keys:
            page = self._read_one(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def _read_one(self, key: PageKey) -> np.ndarray | None:
        path = self.path_of(key)
        try:
            with open(path, "rb") as file:
                raw = bytearray(file.read())
        except OSError:
            self._forget(key)
            return None
        payload_at = _HEADER.size
        if len(raw) >= payload_at:
            magic, length, checksum = _HEADER.unpack_from(raw)
            payload = memoryview(raw)[payload_at:]
            right_size = length == len(payload) and (self.page_bytes is None or length == self.page_bytes)
            if magic == _MAGIC and right_size and zlib.crc32(payload) == checksum:
                with self._lock:
                    if key in self._sizes:
                        self._sizes.move_to_end(key)
                return np.frombuffer(raw, dtype=np.uint8, offset=payload_at)
        logger.warning("KV page file %s is corrupt or truncated: deleted, its tokens are recomputed", path)
        with self._lock:
            self._corrupt += 1
        self._remove(key)
        return None

    def write(self, keys: Sequence[PageKey], pages: Sequence[np.ndarray]) -> None:
        for key, page in zip(keys, pages):
            with self._lock:
                if key in self._sizes:
                    self._sizes.move_to_end(key)
                    continue
            path = self.path_of(key)
            payload = memoryview(np.ascontiguousarray(page)).cast("B")
            path.parent.mkdir(exist_ok=True, mode=_PRIVATE_FOLDER)
            staging = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
            with open(os.open(staging, flags, _PRIVATE_FILE), "wb") as file:
                file.write(_HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)))
                file.write(payload)
            os.replace(staging, path)
            with self._lock:
                self._sizes[key] = _HEADER.size + len(payload)
                self._bytes += _HEADER.size + len(payload)
            self._evict()

    def _evict(self) -> None:
        while True:
            with self._lock:
                if self._bytes <= self.capacity or not self._sizes:
                    return
                key, size = self._sizes.popitem(last=False)
                self._bytes -= size
                self._evictions += 1
            self.path_of(key).unlink(missing_ok=True)

    def _forget(self, key: PageKey) -> None:
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self._bytes -= size

    def _remove(self, key: PageKey) -> None:
        self._forget(key)
        self.path_of(key).unlink(missing_ok=True)

    def usage(self) -> StoreUsage:
        with self._lock:
            return StoreUsage(self._bytes, len(self._sizes), self._evictions, self._corrupt)
