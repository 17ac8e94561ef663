"""Routing by cached pages, without Ray: page events from a real page pool, the directory the
replicas report to, a router's index of it, and the policy that ranks replicas."""

from __future__ import annotations

from serve_app.kv.page_pool import PagePool
from serve_app.kv.prefix_cache import page_hashes
from serve_app.routing.adapter_holders import AdapterHolders
from serve_app.routing.decision import PrefixRouting
from serve_app.routing.page_directory import PageDirectory
from serve_app.routing.policy import RoutingPolicy
from serve_app.routing.prefix_index import PrefixIndex
from serve_app.wire.page_events import PageEventBatch, PageEventBuffer

PAGE = 4


def _fill(pool: PagePool, tokens: list[int], salt: str = "") -> list[int]:
    """Cache `tokens` as a request would: allocate its pages, publish the whole ones, release them all."""
    pages = pool.allocate(-(-len(tokens) // PAGE))
    assert pages is not None
    for page, page_hash in zip(pages, page_hashes(tokens, PAGE, salt)):
        pool.publish(page, page_hash)
    pool.release(pages)
    return pages


def test_a_pool_reports_what_it_caches_and_evicts_as_events() -> None:
    pool = PagePool(n_pages=4, page_size=PAGE)
    log = pool.prefix_cache.record_events()
    assert log.drain() == PageEventBatch(snapshot=frozenset())  # the first drain says what is held: nothing
    first = list(range(8))
    _fill(pool, first)
    batch = log.drain()
    assert batch.stored == frozenset(page_hashes(first, PAGE, "")) and not batch.removed and batch.snapshot is None
    assert not log.drain()
    second = list(range(100, 116))  # four pages: everything cached before is evicted
    _fill(pool, second)
    batch = log.drain()
    assert batch.removed == frozenset(page_hashes(first, PAGE, "")) and batch.stored == frozenset(page_hashes(second, PAGE, ""))
    log.snapshot_next()
    assert log.drain().snapshot == frozenset(page_hashes(second, PAGE, ""))


def test_a_log_nobody_drains_stays_bounded_and_falls_back_to_a_snapshot() -> None:
    pool = PagePool(n_pages=2, page_size=PAGE)
    log = pool.prefix_cache.record_events(limit=6)
    log.drain()
    for start in range(0, 400, 8):
        _fill(pool, list(range(start, start + 8)))
    assert len(log._stored) + len(log._removed) <= 6
    batch = log.drain()
    assert batch.snapshot == frozenset(page_hashes(list(range(392, 400)), PAGE, "")) and not batch.stored


def test_batches_merge_in_order_the_latest_event_winning() -> None:
    a, b, c = b"a", b"b", b"c"
    buffer = PageEventBuffer()
    buffer.add(PageEventBatch(stored=frozenset({a, b})))
    buffer.add(PageEventBatch(removed=frozenset({a}), stored=frozenset({c})))
    assert buffer.take() == PageEventBatch(stored=frozenset({b, c}), removed=frozenset({a}))
    assert not buffer.take()
    buffer.add(PageEventBatch(snapshot=frozenset({a})))
    buffer.add(PageEventBatch(stored=frozenset({b}), removed=frozenset({a})))
    assert buffer.take() == PageEventBatch(snapshot=frozenset({b}))


def test_routers_follow_the_directory_and_catch_up_after_falling_behind() -> None:
    directory = PageDirectory(log_length=3)
    h = [bytes([i]) for i in range(6)]
    directory.publish("r1", PageEventBatch(snapshot=frozenset({h[0], h[1]})), PAGE)
    directory.publish("r2", PageEventBatch(snapshot=frozenset({h[0]})), PAGE)
    index = PrefixIndex()
    index.apply(directory.changes(index.seq))
    assert index.page_size == PAGE
    assert index.matched_pages(h[:3], ["r1", "r2"]) == {"r1": 2, "r2": 1}
    directory.publish("r2", PageEventBatch(stored=frozenset({h[1], h[2]})), PAGE)
    index.apply(directory.changes(index.seq))
    assert index.matched_pages(h[:3], ["r1", "r2"]) == {"r1": 2, "r2": 3}
    for i in range(5):  # more changes than the log keeps: the lagging router gets the whole view
        directory.publish("r1", PageEventBatch(stored=frozenset({h[3 + i % 3]})), PAGE)
    changes = directory.changes(index.seq)
    assert changes.reset
    directory.forget("r2")
    index.apply(directory.changes(index.seq))
    assert index.matched_pages(h[:3], ["r1", "r2"]) == {"r1": 2}
    assert directory.replicas == ["r1"] and len(index) == len(directory.pages_of("r1"))


def test_a_router_counts_leading_pages_only_and_holds_routed_prompts_for_a_while() -> None:
    now = [0.0]
    index = PrefixIndex(provisional_ttl_s=5.0, clock=lambda: now[0])
    directory = PageDirectory()
    h = [bytes([i]) for i in range(4)]
    directory.publish("r1", PageEventBatch(snapshot=frozenset({h[1], h[2]})), PAGE)  # no first page: no prefix
    index.apply(directory.changes(0))
    assert index.matched_pages(h, ["r1"]) == {}
    index.note_routed("r2", h[:3])
    assert index.matched_pages(h, ["r1", "r2"]) == {"r2": 3}
    assert index.matched_pages(h, ["r1"]) == {}  # only candidates count (r2 may be gone)
    now[0] = 6.0
    index.apply(directory.changes(index.seq))
    assert index.matched_pages(h, ["r1", "r2"]) == {} and not index._provisional


def test_the_policy_prefers_the_longest_prefix_until_loads_are_imbalanced() -> None:
    policy = RoutingPolicy(balance_abs_threshold=4, balance_rel_threshold=1.5, min_match_ratio=0.5)
    replicas = ["a", "b", "c"]
    assert policy.rank(replicas, {"a": 3, "b": 0, "c": 0}, {"a": 5, "b": 2}, 6) == [["a"], ["b", "c"]]
    assert policy.rank(replicas, {}, {"a": 2, "b": 2}, 4) == [["a", "b"], ["c"]]
    assert policy.rank(replicas, {}, {}, 4) == [replicas]
    assert policy.rank(replicas, {"a": 9, "b": 2, "c": 4}, {"a": 5}, 6) == [["b", "c"], ["a"]]  # 9 - 2 > 4 and 9 > 3
    assert policy.rank(replicas, {"a": 9, "b": 2, "c": 4}, {"a": 5, "c": 5}, 6) == [["c"], ["b"], ["a"]]  # c: 4 - 2 <= 4
    assert policy.rank(replicas, {"a": 5, "b": 4, "c": 4}, {"a": 5}, 6) == [["a"], ["b", "c"]]  # within the thresholds
    assert policy.rank(replicas, {}, {"a": 1}, 8) == [replicas]  # one shared page of eight: load decides
    assert policy.rank([], {}, {}, 0) == []


def test_tenants_never_route_on_each_others_prefixes() -> None:
    """The cache salt is mixed into the first page's hash: the same tokens of another tenant match nothing."""
    pool = PagePool(n_pages=8, page_size=PAGE)
    log = pool.prefix_cache.record_events()
    tokens = list(range(12))
    _fill(pool, tokens, salt="tenant-a")
    directory = PageDirectory()
    directory.publish("r1", log.drain(), PAGE)
    index = PrefixIndex()
    index.apply(directory.changes(0))
    assert index.matched_pages(list(page_hashes(tokens, PAGE, "tenant-a")), ["r1"]) == {"r1": 3}
    assert index.matched_pages(list(page_hashes(tokens, PAGE, "tenant-b")), ["r1"]) == {}


def test_the_simulated_fleet_keeps_its_hits_and_its_balance() -> None:
    """`bench route --simulate`, small: the router's own code against simulated replicas, beside Serve's
    power-of-two choices on the same trace."""
    from serve_app.bench.route_sim import ReplicaModel, Workload, simulate

    policy = RoutingPolicy()
    for replicas in (2, 4):
        workload = Workload(tenants=8, conversations=24 * replicas, turns=3, arrival_rate=replicas)
        ours = simulate("prefix", replicas, workload, ReplicaModel(), policy)
        default = simulate("pow2", replicas, workload, ReplicaModel(), policy)
        assert ours.requests == default.requests == 24 * replicas * 3
        assert ours.cached_tokens >= 0.9 * ours.ideal_cached_tokens
        assert ours.cached_tokens > default.cached_tokens
        assert max(ours.per_replica) <= 1.5 * min(ours.per_replica), ours.per_replica
        assert ours.decisions.decisions == ours.requests  # one timed decision per request


def test_decision_costs_keep_a_bounded_sample_and_count_them_all() -> None:
    from serve_app.routing.costs import DecisionCosts

    costs = DecisionCosts(keep=100)
    assert costs.summary() == {"decisions": 0}
    for micro in range(1, 1001):
        costs.add(micro * 1e-6)
    summary = costs.summary()
    assert summary["decisions"] == 1000
    assert summary["max_us"] == 1000.0 and summary["p50_us"] == 950.5  # only the latest 100 are kept
    assert 990 <= summary["p99_us"] <= 1000


def test_a_burst_of_decisions_against_equal_loads_spreads_over_the_replicas() -> None:
    """Serve takes the first of equally loaded replicas, and one routing task may route several requests
    before any is sent: successive decisions must not all put the same replica first."""
    from serve_app.routing.decision import PrefixRouting

    routing = PrefixRouting(RoutingPolicy())
    firsts = [routing.rank([], ["a", "b", "c"], {"a": 0, "b": 0, "c": 0})[0][0] for _ in range(6)]
    assert sorted(firsts) == ["a", "a", "b", "b", "c", "c"]
    ranked = [routing.rank([], ["a", "b"], {"a": 3, "b": 0}) for _ in range(2)]
    assert all(sorted(groups[0]) == ["a", "b"] and len(groups) == 1 for groups in ranked)  # one group: Serve takes b


def test_a_request_goes_where_its_lora_adapter_was_sent_unless_its_prefix_or_the_load_decides() -> None:
    routing = PrefixRouting(RoutingPolicy(balance_abs_threshold=4, balance_rel_threshold=1.5, min_match_ratio=0.5))
    replicas, idle = ["r1", "r2", "r3"], {"r1": 0, "r2": 0, "r3": 0}
    assert routing.rank([], replicas, idle, "a") == [replicas[1:] + replicas[:1]]  # nobody holds it: all equal
    routing.routed("r2", [], "a")
    routing.routed("r3", [], "b")
    for _ in range(3):  # whichever candidate the decision starts from
        groups = routing.rank([], replicas, idle, "a")
        assert groups[0] == ["r2"] and sorted(groups[1]) == ["r1", "r3"]
    assert sorted(routing.rank([], replicas, idle, None)[0]) == replicas  # the base model: no preference
    busy = {"r1": 0, "r2": 9, "r3": 0}  # the holder is far busier than the rest: balance first
    groups = routing.rank([], replicas, busy, "a")
    assert sorted(groups[0]) == ["r1", "r3"] and groups[-1] == ["r2"]
    directory = PageDirectory()
    prompt = list(range(8))
    directory.publish("r1", PageEventBatch(snapshot=frozenset(page_hashes(prompt, PAGE, "salt"))), PAGE)
    routing.index.apply(directory.changes(routing.index.seq))
    assert routing.rank(routing.hashes(prompt, "salt"), replicas, idle, "a")[0] == ["r1"]  # its pages win


def test_a_router_remembers_a_bounded_number_of_adapters() -> None:
    holders = AdapterHolders(max_adapters=2)
    for adapter, replica in (("a", "r1"), ("b", "r2"), ("a", "r3"), ("c", "r1")):
        holders.routed(adapter, replica)
    assert (holders.of("a"), holders.of("b"), holders.of("c"), len(holders)) == (
        frozenset({"r1", "r3"}), frozenset(), frozenset({"r1"}), 2
    )
