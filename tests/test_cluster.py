"""The app on a real two-node Ray cluster (two raylets on this machine, one CPU each): autoscaling
adds an engine replica on the other node under load and removes it when idle, streams on a replica
being scaled down finish, and a killed replica's streams end with an error while the others finish.

Autoscaling runs with short delays here (as Ray's own autoscaling tests do), and each replica gets
one torch thread.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import openai
import pytest

from serve_app.bench.idle import is_idle
from serve_app.bench.servers import ServeRun
from tests.inprocess import MODEL, openai_client
from tests.served import TwoNodeCluster

AUTOSCALED = {
    "autoscaling_config": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "metrics_interval_s": 0.5,
        "look_back_period_s": 2, "upscale_delay_s": 0, "downscale_delay_s": 4,
    },
    "ray_actor_options": {"num_cpus": 1},  # one replica per node
    "graceful_shutdown_timeout_s": 300,  # a replica being removed finishes its streams first
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodeCluster]:
    nodes = TwoNodeCluster(tmp_path_factory.mktemp("cluster"))
    yield nodes
    nodes.stop()


@pytest.fixture(scope="module")
def app(cluster: TwoNodeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeRun]:
    run = ServeRun(
        tmp_path_factory.mktemp("cluster-app"), address=cluster.address, proxy_location="HeadOnly", env=cluster.env,
        args={"cache_tokens": 4096, "max_model_len": 1024, "num_threads": 1}, deployments={"EngineDeployment": AUTOSCALED},
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


def test_load_adds_a_replica_on_the_other_node_and_idle_removes_it(app: ServeRun) -> None:
    client = openai_client(app.url)
    assert len(_replicas(app)) == 1
    with ThreadPoolExecutor(12) as pool:
        burst = _load(pool, client, 8, 120)
        _wait_for(lambda: len(_replicas(app)) == 2, 120, "scaled to two replicas")
        nodes = {stats["node_id"] for stats in _replicas(app).values()}
        assert len(nodes) == 2  # one replica per node
        long = _load(pool, client, 2, 400, start=100)  # still running when the load drops below one replica's
        results = [future.result(timeout=600) for future in burst + long]
    assert results == [("length", 120)] * 8 + [("length", 400)] * 2  # nothing lost while scaling down
    _wait_for(lambda: len(_replicas(app)) == 1, 120, "back to one replica")
    _wait_for(lambda: all(is_idle(s) for s in _replicas(app).values()), 30, "idle with every page back")


def test_a_killed_replica_fails_only_its_own_streams(app: ServeRun, cluster: TwoNodeCluster) -> None:
    client = openai_client(app.url)
    with ThreadPoolExecutor(16) as pool:
        warm = _load(pool, client, 8, 60, start=200)
        _wait_for(lambda: len(_replicas(app)) == 2, 120, "scaled to two replicas")
        streams: list[Future] = []  # one more every half second until both replicas run some (by load)
        while not all(s["active_tasks"] > 0 for s in _replicas(app).values()):
            assert len(streams) < 16, _replicas(app)
            streams += _load(pool, client, 1, 300, start=300 + len(streams))
            time.sleep(0.5)
        victim = next(s["pid"] for s in _replicas(app).values())
        assert victim in cluster.engine_replica_pids()
        os.kill(victim, signal.SIGKILL)
        outcomes = []
        for future, tokens in [(f, 60) for f in warm] + [(f, 300) for f in streams]:
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
