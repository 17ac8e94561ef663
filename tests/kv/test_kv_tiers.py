"""The disk tier behind an engine's page pool: a 2,000-token prefix evicted from a small pool by other
traffic comes back from disk with the same greedy tokens as when it was computed; a corrupt or truncated
page file is recomputed; tenants never meet there; and the disk store's own bound, order and checks.
(The host and cluster tiers run under `serve run`: tests/kv/test_kv_tiers_served.py.)"""

from __future__ import annotations

import os
import random
import shutil
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from serve_app import GenerateRequest, InferenceEngine
from serve_app.bench.idle import wait_idle
from serve_app.kv.prefix_cache import page_hashes
from serve_app.kv.tiers.disk import _HEADER, _MAGIC, DiskStore
from serve_app.kv.tiers.pages import page_keys

PAGE = 16
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiered(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceEngine]:
    """A pool of 160 pages (2,560 tokens): one 2,000-token prompt fills most of it."""
    disk = tmp_path_factory.mktemp("kv-disk")
    engine = InferenceEngine(
        compile=False,
        model=str(model_path), cache_tokens=2560, max_model_len=4096, kv_tiers={"disk_path": str(disk), "disk_bytes": "2GiB"}
    )
    yield engine
    engine.shutdown()


def _words(seed: int, count: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(['river', 'stone', 'lamp', 'harbour', 'sail', 'rope'])}{rng.randrange(1000)}"
                    for _ in range(count))


def _prompt(engine: InferenceEngine, seed: int, tokens: int) -> list[int]:
    ids = engine.tokenizer.encode(_words(seed, tokens))
    assert len(ids) >= tokens
    return ids[:tokens]


def _greedy(engine: InferenceEngine, ids: list[int], salt: str = ""):
    result = engine.submit(GenerateRequest(prompt=ids, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                                           client_salt=salt)).wait(300)
    wait_idle(engine.get_stats, timeout=120)  # and every page it published written to disk
    return result


def _evict(engine: InferenceEngine, ids: list[int], salt: str = "") -> None:
    """Other traffic until no page of `ids` is left in the pool."""
    for seed in range(100, 110):
        _greedy(engine, _prompt(engine, seed, 1200), salt="other-traffic")
        if "pool" not in engine.kv.locate(ids, salt):
            return
    raise AssertionError(f"other traffic did not evict the prefix: {engine.kv.locate(ids, salt)}")


def _hits(engine: InferenceEngine) -> dict[str, int]:
    stats = engine.get_stats()
    return {tier: stats[f"prefix_cache_hit_tokens_{tier}"] for tier in ("pool", "host", "disk", "cluster")}


def _disk(engine: InferenceEngine) -> DiskStore:
    assert engine.tiers is not None
    return next(store for store in engine.tiers.stores if isinstance(store, DiskStore))


def test_an_evicted_prefix_comes_back_from_disk_with_the_same_tokens(tiered: InferenceEngine) -> None:
    ids = _prompt(tiered, 1, 2010)
    cold = _greedy(tiered, ids)
    assert cold.cached_tokens == 0
    assert tiered.kv.locate(ids) == ["pool"] * (2010 // PAGE)
    _evict(tiered, ids)
    assert tiered.kv.locate(ids) == ["disk"] * (2010 // PAGE)
    before = _hits(tiered)
    warm = _greedy(tiered, ids)
    after = _hits(tiered)
    assert warm.cached_tokens >= 1984 and warm.cached_tokens == (2010 - 1) // PAGE * PAGE
    assert after["disk"] - before["disk"] == warm.cached_tokens and after["pool"] == before["pool"]
    assert warm.token_ids == cold.token_ids
    stats = tiered.get_stats()
    assert stats["kv_tier_disk_pages"] > 2010 // PAGE and stats["kv_tier_disk_corrupt_pages"] == 0
    assert stats["kv_tier_writes_dropped"] == 0 and stats["kv_tier_load_failures"] == 0


@pytest.mark.parametrize("damage", ["flipped", "truncated", "resized"])
def test_a_damaged_page_file_is_recomputed_and_the_output_is_unchanged(tiered: InferenceEngine, damage: str) -> None:
    """A flipped byte, a cut file, or a crafted page of another size with a valid header and checksum."""
    ids = _prompt(tiered, {"flipped": 2, "truncated": 3, "resized": 6}[damage], 800)
    cold = _greedy(tiered, ids)
    _evict(tiered, ids)
    disk = _disk(tiered)
    path = disk.path_of(page_keys(tiered.tiers.layout, list(page_hashes(ids, PAGE, "")))[5])
    data = bytearray(path.read_bytes())
    if damage == "flipped":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncated":
        del data[len(data) // 2:]
    else:
        payload = bytes(data[_HEADER.size:]) * 2
        data = bytearray(_HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload)
    path.write_bytes(bytes(data))
    corrupt = tiered.get_stats()["kv_tier_disk_corrupt_pages"]
    warm = _greedy(tiered, ids)
    assert warm.cached_tokens == 5 * PAGE  # the five pages before the damaged one; the rest recomputed
    assert warm.token_ids == cold.token_ids
    assert tiered.get_stats()["kv_tier_disk_corrupt_pages"] == corrupt + 1
    assert path.exists()  # deleted when found, then written again from the recomputed page
    assert disk.read(page_keys(tiered.tiers.layout, list(page_hashes(ids, PAGE, ""))[5:6]))


def test_tenants_never_meet_in_the_disk_tier(tiered: InferenceEngine) -> None:
    ids = _prompt(tiered, 4, 800)
    _greedy(tiered, ids, salt="tenant-a")
    _evict(tiered, ids, salt="tenant-a")
    before = _hits(tiered)
    other = _greedy(tiered, ids, salt="tenant-b")
    assert other.cached_tokens == 0 and _hits(tiered) == before
    _evict(tiered, ids, salt="tenant-a")
    before = _hits(tiered)
    same = _greedy(tiered, ids, salt="tenant-a")
    assert same.cached_tokens == (800 - 1) // PAGE * PAGE
    assert _hits(tiered)["disk"] - before["disk"] == same.cached_tokens


def test_a_tier_that_is_gone_is_a_miss_and_the_request_recomputes(tiered: InferenceEngine) -> None:
    ids = _prompt(tiered, 5, 800)
    cold = _greedy(tiered, ids)
    _evict(tiered, ids)
    shutil.rmtree(_disk(tiered).folder)  # every read and write of the disk tier fails from now on
    warm = _greedy(tiered, ids)
    assert warm.cached_tokens == 0 and warm.finish_reason == "length" and warm.token_ids == cold.token_ids
    assert tiered.kv.locate(ids) == ["pool"] * (800 // PAGE)


def _page(value: int, size: int = 1000) -> np.ndarray:
    return np.full(size, value, dtype=np.uint8)


def test_the_disk_store_keeps_its_bound_least_recently_used_out(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, capacity_bytes=3 * 1100)
    keys = [bytes([i]) * 32 for i in range(4)]
    store.write(keys[:3], [_page(i) for i in range(3)])
    assert store.held(keys) == 3
    assert store.read(keys[:1])[0][0] == 0  # key 0 is now the most recently used
    store.write(keys[3:], [_page(3)])
    usage = store.usage()
    assert usage.pages == 3 and usage.evictions == 1 and usage.bytes <= 3 * 1100
    assert store.held(keys[1:2]) == 0 and store.held(keys[2:]) == 2 and store.held(keys[:1]) == 1
    again = DiskStore(tmp_path, capacity_bytes=2 * 1100)  # a later engine adopts the files, oldest out first
    assert again.usage().pages == 2 and again.usage().evictions == 1


def test_the_disk_store_reads_a_run_up_to_its_first_bad_file(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, capacity_bytes=1 << 20)
    keys = [bytes([i]) * 32 for i in range(3)]
    store.write(keys, [_page(i) for i in range(3)])
    with open(store.path_of(keys[1]), "r+b") as file:
        file.truncate(10)  # shorter than its header
    pages = store.read(keys)
    assert [int(page[0]) for page in pages] == [0]
    assert pages[0].flags.writeable  # the engine makes tensors of it
    assert not store.path_of(keys[1]).exists() and store.usage().corrupt == 1


def test_the_disk_store_is_the_servers_own_and_reads_only_pages_of_its_size(tmp_path: Path) -> None:
    old = tmp_path / "kv"
    (old / "ab").mkdir(parents=True, mode=0o755)
    os.chmod(old, 0o755)
    store = DiskStore(old, capacity_bytes=1 << 20, page_bytes=1000)
    keys = [bytes([i]) * 32 for i in range(3)]
    store.write(keys, [_page(0), _page(1, size=999), _page(2)])
    assert stat.S_IMODE(old.stat().st_mode) == 0o700 and stat.S_IMODE((old / "ab").stat().st_mode) == 0o700
    for key in keys:
        path = store.path_of(key)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [int(page[0]) for page in store.read(keys)] == [0]  # the page of 999 bytes is a miss, deleted
    assert not store.path_of(keys[1]).exists() and store.usage().corrupt == 1


def test_the_tiers_config_is_checked_where_it_is_given() -> None:
    from serve_app.config import EngineConfig

    tiers = EngineConfig.from_options(kv_tiers={"host_bytes": "4GiB", "disk_path": "/tmp/kv", "cluster": True}).tiers
    assert tiers.host_bytes == 4 * 2**30 and tiers.disk_bytes == 16 * 2**30 and tiers.needs_ray
    with pytest.raises(ValueError, match="hosts_bytes"):
        EngineConfig.from_options(kv_tiers={"hosts_bytes": "4GiB"})
    with pytest.raises(ValueError, match="kv_tiers: they hold the prefix cache's pages"):
        EngineConfig.from_options(kv_cache="contiguous", kv_tiers={"disk_path": "/tmp/kv"})
    with pytest.raises(ValueError, match="host_bytes"):
        EngineConfig.from_options(kv_tiers={"host_bytes": "lots"})

