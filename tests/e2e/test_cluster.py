"""The app on a real two-node Ray cluster started first, as a user starts one (`ray start --head`, then
`ray start --address=...` for a second raylet, one CPU each, token authentication on): `serve run
--address` onto it, its model a folder only the head node has; autoscaling adds an engine replica on the
other node under load (which copies the model from the head into that node's own cache folder) and
removes it when idle, streams on a replica being scaled down finish, a killed replica's streams end with
an error while the others finish, and a `serve deploy` of a changed config rolls the replicas under
streams without dropping one.

The changed config is the cluster KV tier's: two engine replicas, one per node, each writing the pages it
computes to its own node's host tier. While the replica that computed a prefix is busy, the router sends
the same prompt to the other replica, which fetches those pages from the first node's store through Ray
instead of recomputing them, and answers the greedy tokens the first one computed.

Autoscaling runs with short delays here (as Ray's own autoscaling tests do). Each engine replica
reserves one CPU, and so runs one torch thread. The tests run in order, each on the app the one before
left.
"""

from __future__ import annotations

import filecmp
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import openai
import pytest
import yaml

from serve_app.bench.idle import is_idle
from serve_app.bench.servers import ServeRun
from tests.inprocess import MODEL, openai_client
from tests.served import TwoNodeCluster, greedy_completion, random_ids, router_config

AUTOSCALED = {
    "autoscaling_config": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "metrics_interval_s": 0.5,
        "look_back_period_s": 2, "upscale_delay_s": 0, "downscale_delay_s": 4,
    },
    "ray_actor_options": {"num_cpus": 1},  # one replica per node
}
ENGINE_KWARGS = {"cache_tokens": 4096, "max_model_len": 1024, "compile": False}  # eager: these tests are about placement; the card's own app (conftest's `served`) runs compiled
PAGE = 16
PREFIX = 1500
# The config `serve deploy` rolls the app to: the cluster KV tier on two replicas, one per node.
TIERED_KWARGS = {"cache_tokens": 6144, "max_model_len": 2048, "kv_tiers": {"host_bytes": "512MiB", "cluster": True}}
TWO_REPLICAS = {
    "autoscaling_config": {"min_replicas": 2, "max_replicas": 2},
    "ray_actor_options": {"num_cpus": 1},  # one replica per node
    # Any difference in load counts: a busy replica's prefix goes to the idle one.
    "request_router_config": router_config(balance_abs_threshold=0, balance_rel_threshold=1.0),
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, head_only: Path) -> Iterator[TwoNodeCluster]:
    nodes = TwoNodeCluster(tmp_path_factory.mktemp("cluster"), head_only)
    yield nodes
    nodes.stop()


@pytest.fixture(scope="module")
def app(cluster: TwoNodeCluster, head_only: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeRun]:
    run = ServeRun(
        tmp_path_factory.mktemp("cluster-app"), address=cluster.address, proxy_location="HeadOnly", env=cluster.env,
        models=[{"model_loading_config": {"model_id": MODEL, "model_source": str(head_only / "smollm2")}}],
        engine_kwargs=ENGINE_KWARGS, engine_deployment=AUTOSCALED, plain=True,
    )
    yield run
    run.stop()


def _replicas(app: ServeRun) -> dict[str, dict]:
    return httpx.get(f"{app.url}/stats/replicas", timeout=10).json()


def _wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout} s")
        time.sleep(0.25)


def _stream(client: openai.OpenAI, index: int, tokens: int) -> tuple[str | None, int]:
    """(finish reason, tokens received) of one streamed chat completion, its prompt its own."""
    messages = [{"role": "system", "content": f"You tell story {index}."}, {"role": "user", "content": "Go on."}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=tokens,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    finish, received = None, 0
    for chunk in stream:
        if chunk.usage is not None:
            received = chunk.usage.completion_tokens
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
    return finish, received


def _load(pool: ThreadPoolExecutor, client: openai.OpenAI, count: int, tokens: int, start: int = 0) -> list[Future]:
    return [pool.submit(_stream, client, start + i, tokens) for i in range(count)]


def _load_until(condition: Callable[[], bool], pool: ThreadPoolExecutor, client: openai.OpenAI, tokens: int,
                start: int, timeout: float = 180) -> list[Future]:
    """Streams, four more whenever fewer than six run, until `condition` holds: load that lasts however
    long a new replica takes to start (preparing its model on a node that has none takes a while)."""
    streams: list[Future] = []
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or len(streams) >= 64:
            raise AssertionError(f"not met after {len(streams)} streams")
        if sum(not stream.done() for stream in streams) < 6:
            streams += _load(pool, client, 4, tokens, start + len(streams))
        time.sleep(0.5)
    return streams


def test_load_adds_a_replica_on_the_other_node_and_idle_removes_it(
    app: ServeRun, cluster: TwoNodeCluster, head_only: Path
) -> None:
    client = openai_client(app.url)
    assert len(_replicas(app)) == 1
    with ThreadPoolExecutor(24) as pool:
        burst = _load_until(lambda: len(_replicas(app)) == 2, pool, client, 120, start=0)
        nodes = {stats["node_id"] for stats in _replicas(app).values()}
        assert len(nodes) == 2  # one replica per node
        # The replica on the second node, which cannot see the head's model folder, copied it from the head
        # into that node's own cache folder.
        copied = list((cluster.worker_cache / "models" / "copied").glob("smollm2-*"))
        assert len(copied) == 1 and (copied[0] / ".prepared").is_file()
        assert filecmp.cmp(copied[0] / "smollm2" / "model.safetensors", head_only / "smollm2" / "model.safetensors",
                           shallow=False)
        worker_replicas = [proc for node, proc in cluster.engine_replicas() if node == "worker"]
        assert [proc.environ().get("SERVE_APP_CACHE_DIR") for proc in worker_replicas] == [str(cluster.worker_cache)]
        long = _load(pool, client, 2, 400, start=100)  # still running when the load drops below one replica's
        results = [future.result(timeout=600) for future in burst + long]
    assert results == [("length", 120)] * len(burst) + [("length", 400)] * 2  # nothing lost while scaling down
    _wait_for(lambda: len(_replicas(app)) == 1, 120, "back to one replica")
    _wait_for(lambda: all(is_idle(s) for s in _replicas(app).values()), 30, "idle with every page back")


def test_a_killed_replica_fails_only_its_own_streams(app: ServeRun, cluster: TwoNodeCluster) -> None:
    long_tokens = 160  # tokens: long enough to outlast the 60-token warm-up streams started before them
    client = openai_client(app.url)
    with ThreadPoolExecutor(32) as pool:
        warm = _load_until(lambda: len(_replicas(app)) == 2, pool, client, 60, start=200)
        # Long streams, one more every half second while fewer than six run (the load stays what the warm-up
        # streams need to end), until both replicas run some and the short warm-up streams have ended:
        # whatever the victim runs when it is killed is then a long stream in flight.
        streams = _load(pool, client, 4, long_tokens, start=300)
        deadline = time.monotonic() + 120
        while not (all(f.done() for f in warm) and all(s["active_tasks"] > 0 for s in _replicas(app).values())):
            replicas = {rid: (s["active_tasks"], s["total_tasks"]) for rid, s in _replicas(app).items()}
            warm_done = f"{sum(f.done() for f in warm)} of {len(warm)} warm-up streams done"
            assert time.monotonic() < deadline, (replicas, warm_done, f"{len(streams)} long streams")
            if sum(not f.done() for f in streams) < 6:
                streams += _load(pool, client, 1, long_tokens, start=300 + len(streams))
            time.sleep(0.5)
        # The replica with the most streams in flight (its report may be a moment old: the busier, the surer).
        victim = max(_replicas(app).values(), key=lambda s: s["active_tasks"])["pid"]
        assert victim in [proc.pid for _, proc in cluster.engine_replicas()]
        os.kill(victim, signal.SIGKILL)
        outcomes = []
        for future, tokens in [(f, 60) for f in warm] + [(f, long_tokens) for f in streams]:
            try:
                finish, received = future.result(timeout=600)
                outcomes.append(("finished", received == tokens and finish == "length"))
            except openai.APIError as error:
                outcomes.append(("error", str(error)))
    failed = [message for kind, message in outcomes if kind == "error"]  # the killed replica's streams
    assert failed and all(whole for kind, whole in outcomes if kind == "finished"), outcomes
    assert len(failed) < len(outcomes)  # only the killed replica's streams fail
    assert all("engine replica" in message for message in failed), failed
    after = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert after.choices[0].message.content is not None  # new requests go to a live replica
    _wait_for(lambda: len(_replicas(app)) >= 1 and all(is_idle(s) for s in _replicas(app).values()), 120,
              "a live replica, idle with every page back")


def test_the_cluster_refuses_a_process_without_its_token(app: ServeRun, cluster: TwoNodeCluster, tmp_path) -> None:
    assert cluster.serve_cli("status").returncode == 0
    other = tmp_path / "another-token"
    other.write_text(secrets.token_hex(32))
    refused = cluster.serve_cli("status", token=other)
    assert refused.returncode != 0 and "token is invalid" in refused.stdout + refused.stderr


def test_a_changed_config_deployed_rolls_the_replicas_without_dropping_a_stream(
    app: ServeRun, cluster: TwoNodeCluster
) -> None:
    _wait_for(lambda: len(_replicas(app)) == 1 and all(is_idle(s) for s in _replicas(app).values()), 120, "settled")
    before = set(_replicas(app))
    config = yaml.safe_load(app.config_path.read_text())
    (llm,) = config["applications"][0]["args"]["llm_configs"]
    llm["engine_kwargs"].update(TIERED_KWARGS)
    llm["deployment_config"].update(TWO_REPLICAS)
    changed = app.config_path.with_name("changed.yaml")
    changed.write_text(yaml.safe_dump(config))
    client = openai_client(app.url)
    with ThreadPoolExecutor(8) as pool:
        streams = _load(pool, client, 8, 100, start=500)
        _wait_for(lambda: sum(s["active_tasks"] + s["waiting_queue"] for s in _replicas(app).values()) >= 8, 60, "streaming")
        deployed = cluster.serve_cli("deploy", str(changed))
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        results = [future.result(timeout=600) for future in streams]
    assert results == [("length", 100)] * 8  # every stream in flight ended whole

    def rolled() -> bool:  # two new replicas, one on each node
        replicas = _replicas(app)
        return (
            len(replicas) == 2 and not set(replicas) & before and len({s["node_id"] for s in replicas.values()}) == 2
            and all(s["kv_pages_total"] == TIERED_KWARGS["cache_tokens"] // PAGE for s in replicas.values())
        )

    _wait_for(rolled, 300, "rolled to two replicas with the new config")
    status = cluster.serve_cli("status")
    assert status.returncode == 0 and "RUNNING" in status.stdout, status.stdout + status.stderr
    after = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert after.choices[0].finish_reason in ("stop", "length")  # new requests go to the new replicas


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
