"""The host tier under the card's own command (`serve run`, a user's environment): a 2,000-token prefix
evicted from a small pool by other traffic comes back from this node's page store with the greedy tokens
it had when computed, shown in the metrics and the KV SDK's lookup; another tenant's salt never hits it;
and after the engine replica's process is killed, the replica Serve starts again still finds it there."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from serve_app.bench.servers import ServeRun
from serve_app.kvsdk import KVContext, connect
from tests.served import greedy_completion, metric_samples, random_ids

PAGE = 16
PREFIX = 2010
ENGINE_KWARGS = {
    "cache_tokens": 2560, "max_model_len": 4096, "kv_tiers": {"host_bytes": "1GiB"},
    "compile": False,  # eager: these tests are about the KV tiers; the card's own app (conftest's `served`) runs compiled
}


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeRun]:
    run = ServeRun(tmp_path_factory.mktemp("kv-tiers"), engine_kwargs=ENGINE_KWARGS, plain=True)
    yield run
    run.stop()


def evict(url: str, kv: KVContext, ids: list[int]) -> None:
    """Other traffic until no page of `ids` is left in the pool."""
    for seed in range(100, 110):
        greedy_completion(url, random_ids(seed, 1200))
        if "pool" not in kv.locate(ids):
            return
    raise AssertionError(f"other traffic did not evict the prefix: {kv.locate(ids)}")


def _host_hits(url: str) -> float:
    return metric_samples(url).total("serve_app:prefix_cache_tier_hits_total", tier="host")


def test_an_evicted_prefix_comes_back_from_the_host_tier(app: ServeRun) -> None:
    kv = connect(app.url)
    ids = random_ids(1, PREFIX)
    cold, cached = greedy_completion(app.url, ids)
    assert cached == 0 and kv.locate(ids) == ["pool"] * (PREFIX // PAGE)
    evict(app.url, kv, ids)
    assert kv.locate(ids) == ["host"] * (PREFIX // PAGE) and kv.lookup(ids) == 0
    before = _host_hits(app.url)
    warm, warm_cached = greedy_completion(app.url, ids)
    assert warm_cached >= 1984 and warm_cached == (PREFIX - 1) // PAGE * PAGE
    assert warm == cold
    samples = metric_samples(app.url)
    assert samples.total("serve_app:prefix_cache_tier_hits_total", tier="host") - before == warm_cached
    assert samples.total("serve_app:kv_tier_bytes", tier="host") >= PREFIX // PAGE * PAGE * 46080  # bytes a token's KV takes
    _, cached = greedy_completion(app.url, ids[: 10 * PAGE + 1], salt="another-tenant")
    assert cached == 0 and _host_hits(app.url) - before == warm_cached  # no hit anywhere for the other salt


def _replica(url: str) -> tuple[str, dict]:
    replicas = httpx.get(f"{url}/stats/replicas", timeout=10).json()
    assert len(replicas) == 1, replicas
    return next(iter(replicas.items()))


def test_a_restarted_replica_still_finds_the_prefix_in_the_host_tier(app: ServeRun) -> None:
    ids = random_ids(2, PREFIX)
    cold, _ = greedy_completion(app.url, ids)
    killed, stats = _replica(app.url)
    os.kill(stats["pid"], signal.SIGKILL)  # the replica's process; its engine process follows it
    deadline = time.monotonic() + 240
    while True:
        try:
            replica, stats = _replica(app.url)
            if replica != killed and httpx.get(f"{app.url}/health", timeout=10).status_code == 200:
                break
        except (httpx.HTTPError, AssertionError):
            pass
        assert time.monotonic() < deadline, "Serve did not start the killed replica again"
        time.sleep(1)
    assert connect(app.url).locate(ids) == ["host"] * (PREFIX // PAGE)
    warm, cached = greedy_completion(app.url, ids)
    assert cached == (PREFIX - 1) // PAGE * PAGE and warm == cold
    assert _replica(app.url)[1]["prefix_cache_hit_tokens_host"] == cached  # the new replica's first hit
