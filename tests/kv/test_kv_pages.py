"""The paged cache's parts without a model: allocator, prefix cache, page pool, page cache, views."""

from __future__ import annotations

import pytest
import torch

from serve_app.kv.allocator import Allocator
from serve_app.kv.contiguous import ContiguousCache
from serve_app.kv.page_cache import PageCache
from serve_app.kv.page_pool import PagePool
from serve_app.kv.pins import PinTable
from serve_app.kv.prefix_cache import PrefixCache, chain_hash
from serve_app.kv.storage import KVShape
from serve_app.kv.transfer import KVTransfer
from serve_app.kv.view import BatchEntry

SHAPE = KVShape(n_layers=2, n_kv_heads=2, head_dim=4, dtype=torch.float32)
CPU = torch.device("cpu")


def test_allocator_all_or_nothing_and_lru_eviction() -> None:
    evicted: list[int] = []
    alloc = Allocator(4, on_evict=evicted.append)
    pages = alloc.allocate(4)
    assert sorted(pages) == [0, 1, 2, 3] and alloc.num_free == 0
    assert alloc.allocate(1) is None
    cached = {pages[0], pages[1]}
    alloc.release([pages[1]], cached.__contains__)
    alloc.release([pages[0]], cached.__contains__)
    alloc.release([pages[2]], cached.__contains__)
    assert alloc.num_free == 3
    # A never-cached page is reused before any cached one is evicted; then LRU order.
    assert alloc.allocate(1) == [pages[2]] and evicted == []
    assert alloc.allocate(1) == [pages[1]] and evicted == [pages[1]]
    alloc.retain(pages[0])
    assert alloc.refs(pages[0]) == 1 and alloc.num_free == 0
    with pytest.raises(RuntimeError):
        alloc.release([pages[3], pages[3]], cached.__contains__)


def test_chain_hash_mixes_salt_into_first_page_only_through_the_chain() -> None:
    a = chain_hash(None, [1, 2, 3], "")
    assert a == chain_hash(None, [1, 2, 3], "")
    assert a != chain_hash(None, [1, 2, 3], "tenant-b")
    assert a != chain_hash(None, [1, 2, 4], "")
    assert chain_hash(a, [4, 5, 6], "") != chain_hash(chain_hash(None, [1, 2, 3], "x"), [4, 5, 6], "")
    cache = PrefixCache()
    assert cache.insert(a, 7) and not cache.insert(a, 8)
    assert cache.lookup(a) == 7 and cache.is_cached(7)
    cache.drop(7)
    assert cache.lookup(a) is None and len(cache) == 0


def test_page_pool_matches_published_pages_and_forgets_evicted_ones() -> None:
    pool = PagePool(n_pages=3, page_size=2)
    tokens = [10, 11, 12, 13, 14]
    pages = pool.allocate(3)
    parent = None
    for index in range(2):
        parent = chain_hash(parent, tokens[index * 2 : index * 2 + 2], "s")
        pool.publish(pages[index], parent)
    pool.release(pages)
    assert pool.num_free == 3
    matched, last = pool.match_prefix(tokens, "s", max_pages=10)
    assert matched == pages[:2] and last == parent
    assert pool.match_prefix(tokens, "other", max_pages=10)[0] == []
    pool.release(matched)
    # Three allocations evict both cached pages; the prefix is gone.
    pool.release(pool.allocate(3))
    assert pool.match_prefix(tokens, "s", max_pages=10)[0] == []


def test_page_cache_shares_full_prefix_pages_between_tasks() -> None:
    cache = PageCache(SHAPE, num_tokens=64, page_size=4, device=CPU)
    prompt = list(range(100, 111))  # 11 tokens: 2 full pages + 3
    assert cache.admit(1, prompt, "") == 0
    cache.commit(1, prompt, len(prompt))
    assert cache.tasks[1].num_published == 2
    second = prompt[:8] + [7, 7, 7, 7]
    assert cache.admit(2, second, "") == 8
    shared = cache.tasks[1].pages[:2]
    assert cache.tasks[2].pages[:2] == shared
    assert all(cache.pool.allocator.refs(p) == 2 for p in shared)
    assert cache.admit(3, second, "other-salt") == 0
    for task in (1, 2, 3):
        cache.release(task)
    assert cache.usage().free == cache.usage().total


def test_page_cache_recomputes_the_last_token_of_a_fully_cached_prompt() -> None:
    cache = PageCache(SHAPE, num_tokens=64, page_size=4, device=CPU)
    prompt = list(range(8))
    cache.admit(1, prompt, "")
    cache.commit(1, prompt, 8)
    assert cache.admit(2, prompt, "") == 4
    cache.release(1)
    cache.release(2)


def test_page_cache_refuses_admission_without_memory_and_takes_nothing() -> None:
    cache = PageCache(SHAPE, num_tokens=40, page_size=4, device=CPU)  # 10 pages, 1 kept in reserve
    assert cache.max_task_tokens == 36
    assert cache.admit(1, list(range(30)), "") == 0  # 8 pages
    free = cache.usage().free
    assert cache.admit(2, list(range(50, 58)), "") is None
    assert cache.usage().free == free
    assert cache.grow(1, 36) and not cache.grow(1, 41)
    cache.release(1)
    assert cache.usage().free == 10


def test_under_eviction_pressure_a_cached_prefix_loses_its_tail_never_its_head() -> None:
    cache = PageCache(SHAPE, num_tokens=40, page_size=4, device=CPU)  # 10 pages, 1 kept in reserve
    prompt = list(range(100, 117))  # 4 full pages + 1 token
    cache.admit(1, prompt, "")
    cache.commit(1, prompt, len(prompt))
    cache.release(1)  # 4 published pages become evictable, the fifth is free
    free = cache.usage().free
    for evicted in range(1, 5):
        # A task that needs every never-used page and `evicted` cached ones.
        other = list(range(500, 500 + 4 * (free - 4 + evicted)))
        assert cache.admit(2, other[: 4 * (free - 5 + evicted)], "x") == 0
        assert cache.grow(2, len(other))
        matched, _ = cache.pool.match_prefix(prompt, "", max_pages=4)
        assert len(matched) == 4 - evicted, f"after {evicted} evictions the prefix kept {len(matched)} pages"
        cache.pool.release(matched)
        cache.release(2)


def _cached(pool: PagePool, tokens: list[int], salt: str) -> int:
    """How many of `tokens`' leading pages the pool holds now."""
    matched, _ = pool.match_prefix(tokens, salt, max_pages=100)
    pool.release(matched)
    return len(matched)


def test_a_pinned_prefix_outlives_eviction_until_it_expires_or_the_pool_needs_its_room() -> None:
    pool = PagePool(n_pages=8, page_size=2)
    now = [0.0]
    pool.pins._clock = lambda: now[0]
    pinned, unpinned = [1, 2, 3, 4], [5, 6, 7, 8]
    for tokens, salt in ((pinned, "a"), (unpinned, "b")):
        pages = pool.allocate(2)
        parent = None
        for index, page in enumerate(pages):
            parent = chain_hash(parent, tokens[index * 2 : index * 2 + 2], salt)
            pool.publish(page, parent)
        pool.release(pages)
    assert pool.pin(pinned, "a", ttl_s=300) == 4 and pool.pin(pinned, "a", ttl_s=60) == 4  # the second extends
    assert pool.allocator.num_free == 6 and pool.num_free == 8 and pool.pins.num_pages == 2  # pinned: free to take
    pool.release(pool.allocate(6))  # every free page, the unpinned prefix's among them
    assert _cached(pool, unpinned, "b") == 0 and _cached(pool, pinned, "a") == 2
    taken = pool.allocate(7)  # more than the unpinned room: the pin is let go (to a tier, where there is one)
    assert taken is not None and len(pool.pins) == 0 and _cached(pool, pinned, "a") == 1  # evicted tail first
    pool.release(taken)
    assert pool.pin([9, 9, 9, 9], "c", ttl_s=1) == 0  # nothing cached: nothing to pin
    pages = pool.allocate(2)
    pool.publish(pages[0], chain_hash(None, [9, 9], "c"))
    pool.release(pages)
    assert pool.pin([9, 9, 9, 9], "c", ttl_s=10) == 2
    now[0] = 11.0
    pool.allocate(0)  # any allocation lets expired pins go
    assert len(pool.pins) == 0 and pool.num_free == 8 and _cached(pool, [9, 9], "c") == 1


def test_pins_hold_at_most_their_share_letting_the_soonest_expiring_go() -> None:
    retained, released = [], []
    table = PinTable(2, retained.append, released.extend, num_free=lambda: 0, clock=lambda: 0.0)
    assert not table.pin(b"long", [1, 2, 3], ttl_s=5) and retained == []
    assert table.pin(b"short", [1], ttl_s=5) and table.pin(b"later", [2, 3], ttl_s=10)
    assert released == [1] and table.num_pages == 2 and len(table) == 1


def test_a_store_that_fails_midway_gives_every_page_back(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = PageCache(SHAPE, num_tokens=64, page_size=4, device=CPU)
    transfer = KVTransfer(cache, vocab_size=1000)
    tokens = list(range(12))
    kv = torch.randn(2, SHAPE.n_layers, 12, SHAPE.n_kv_heads * SHAPE.head_dim)
    assert transfer.store(kv[:, :, :4], tokens[:4], "").stored_pages == 1  # the first page is cached
    free = cache.usage().free
    publish = cache.pool.publish
    published: list[int] = []

    def publish_once(page: int, page_hash: bytes) -> None:
        if published:
            raise RuntimeError("injected copy failure")
        published.append(page)
        publish(page, page_hash)

    monkeypatch.setattr(cache.pool, "publish", publish_once)
    with pytest.raises(RuntimeError, match="injected"):
        transfer.store(kv, tokens, "")
    assert cache.usage().free == free
    assert all(cache.pool.allocator.refs(page) == 0 for page in range(cache.pool.n_pages))
    monkeypatch.undo()
    assert transfer.lookup(tokens, "") == 8  # what was stored before the failure is still cached


def test_contiguous_cache_hands_out_slots() -> None:
    cache = ContiguousCache(SHAPE, num_tokens=2 * 32, max_seq_len=32, device=CPU)
    assert cache.usage().total == 2
    assert cache.admit(1, [1, 2], "") == 0 and cache.admit(2, [1, 2], "") == 0
    assert cache.admit(3, [1, 2], "") is None
    assert cache.grow(1, 32) and not cache.grow(1, 33)
    cache.release(1)
    assert cache.admit(3, [1, 2], "") == 0


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_view_reads_back_what_it_wrote(kind: str) -> None:
    """k/v written through a view come back as each task's context, in position order."""
    if kind == "paged":
        cache = PageCache(SHAPE, num_tokens=128, page_size=3, device=CPU)
    else:
        cache = ContiguousCache(SHAPE, num_tokens=128, max_seq_len=40, device=CPU)
    lengths = {1: 10, 2: 7}
    for task, length in lengths.items():
        cache.admit(task, list(range(length)), "")
    entries = [BatchEntry(1, 0, 10), BatchEntry(2, 0, 7)]
    k = torch.randn(17, 2, 4)
    v = torch.randn(17, 2, 4)
    cache.view(entries).write(0, k, v)
    decode = [BatchEntry(2, 7, 1), BatchEntry(1, 10, 1)]
    for task, length in lengths.items():
        cache.grow(task, length + 1)
    view = cache.view(decode)
    k_new, v_new = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    view.write(0, k_new, v_new)
    (group,) = view.decode_groups
    ctx_k, ctx_v = view.context(0, group)
    assert ctx_k.shape == (2, 2, 11, 4)
    assert torch.equal(ctx_k[0, :, :7], k[10:].transpose(0, 1))
    assert torch.equal(ctx_k[0, :, 7], k_new[0])
    assert torch.equal(ctx_v[1, :, :10], v[:10].transpose(0, 1))
    assert torch.equal(ctx_v[1, :, 10], v_new[1])
    mask = group.mask
    assert mask[0, 0, 0].tolist() == [True] * 8 + [False] * 3
    assert mask[1, 0, 0].all()
