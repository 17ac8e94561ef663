"""The cluster tier on a real two-node Ray cluster (`ray start --head`, then a second raylet, one CPU each):
two engine replicas, one per node, each writing the pages it computes to its own node's host tier. While
the replica that computed a prefix is busy, the router sends the same prompt to the other replica, which
fetches those pages from the first node's store through Ray instead of recomputing them, and answers the
greedy tokens the first one computed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from serve_app.bench.servers import ServeRun
from tests.inprocess import MODEL, openai_client
from tests.served import TwoNodeCluster, greedy_completion, random_ids, router_config

PAGE = 16
PREFIX = 1500
TWO_REPLICAS = {
    "autoscaling_config": {"min_replicas": 2, "max_replicas": 2},
    "ray_actor_options": {"num_cpus": 1},  # one replica per node
    # Any difference in load counts: a busy replica's prefix goes to the idle one.
    "request_router_config": router_config(balance_abs_threshold=0, balance_rel_threshold=1.0),
}


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, head_only: Path) -> Iterator[ServeRun]:
    cluster = TwoNodeCluster(tmp_path_factory.mktemp("tiers-cluster"), head_only)
    try:
        run = ServeRun(
            tmp_path_factory.mktemp("tiers-cluster-app"), address=cluster.address, proxy_location="HeadOnly",
            env=cluster.env, plain=True, engine_deployment=TWO_REPLICAS,
            models=[{"model_loading_config": {"model_id": MODEL, "model_source": str(head_only / "smollm2")}}],
            engine_kwargs={"cache_tokens": 4096, "max_model_len": 2048, "compile": False,  # the card's app runs compiled
                           "kv_tiers": {"host_bytes": "512MiB", "cluster": True}},
        )
        try:
            _until_both_replicas_report(run)
            yield run
        finally:
            run.stop()
    finally:
        cluster.stop()


def _replicas(run: ServeRun) -> dict[str, dict]:
    return httpx.get(f"{run.url}/stats/replicas", timeout=10).json()


def _until_both_replicas_report(run: ServeRun) -> None:
    deadline = time.monotonic() + 240
    while len(replicas := _replicas(run)) < 2 or len({s["node_id"] for s in replicas.values()}) < 2:
        assert time.monotonic() < deadline, f"not one replica on each node: {replicas}"
        time.sleep(1)


def _busy_with(run: ServeRun, ids: list[int]) -> None:
    """A long greedy stream of `ids` and more: it goes where `ids` is cached and keeps that replica busy."""
    stream = openai_client(run.url).completions.create(
        model=MODEL, prompt=ids + [42] * PAGE, max_tokens=250, temperature=0, stream=True, timeout=300,
        extra_body={"ignore_eos": True},
    )
    for _ in stream:
        pass


def test_a_prefix_computed_on_one_node_is_a_cluster_hit_on_the_other(app: ServeRun) -> None:
    ids = random_ids(3, PREFIX)
    cold, cached = greedy_completion(app.url, ids)
    assert cached == 0
    (computed_on,) = [r for r, s in _replicas(app).items() if s["prompt_tokens"] >= PREFIX]
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(_busy_with, app, ids)
        deadline = time.monotonic() + 60
        while _replicas(app)[computed_on]["active_tasks"] == 0:  # the router sees its load with the same reports
            assert time.monotonic() < deadline and not busy.done(), "the long stream did not start"
            time.sleep(0.1)
        time.sleep(0.5)
        warm, cached = greedy_completion(app.url, ids, wait_idle_after=False)
        assert not busy.done(), "the busy replica finished before the prompt was routed; routing was not tested"
        busy.result()
    replicas = _replicas(app)
    (other,) = [r for r in replicas if r != computed_on]
    assert replicas[other]["node_id"] != replicas[computed_on]["node_id"]
    assert replicas[other]["prefix_cache_hit_tokens_cluster"] == cached == (PREFIX - 1) // PAGE * PAGE
    assert warm == cold
