"""`serve-app batch` on a two-node Ray cluster started first (`ray start`), as a user runs it: every line gets
exactly one result line, both nodes' engines take lines, a killed engine actor loses none, and a run killed
midway resumes with only the lines it had not answered."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from serve_app.bench.servers import ROOT, users_environment
from tests.served import TwoNodeCluster

MODEL = "tiny-llama"
ENGINE_ACTOR_TASK = "MapWorker(MapBatches(BatchEngine)).submit"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, head_only: Path) -> Iterator[TwoNodeCluster]:
    nodes = TwoNodeCluster(tmp_path_factory.mktemp("batch-cluster"), head_only)
    nodes.wait_for_both_nodes()
    yield nodes
    nodes.stop()


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> Path:
    """serve_config.yaml with the tiny model, uncompiled, its engine on one CPU (so one fits each node)."""
    serve_config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    llm = serve_config["applications"][0]["args"]["llm_configs"][0]
    llm["model_loading_config"] = {"model_id": MODEL, "model_source": str(tiny_llama_path)}
    llm["engine_kwargs"].update(compile=False, cache_tokens=8192, max_model_len=1024)
    llm["deployment_config"]["ray_actor_options"]["num_cpus"] = 1
    path = tmp_path_factory.mktemp("batch-config") / "serve_config.yaml"
    path.write_text(yaml.safe_dump(serve_config))
    return path


def requests(path: Path, count: int, max_tokens: int = 8) -> list[str]:
    """`count` chat lines (every fourth sharing a system prompt) and two bad ones; their keys."""
    system = {"role": "system", "content": "You answer questions about rivers, in one sentence. " * 4}
    lines, keys = [], []
    for index in range(count):
        messages = [{"role": "user", "content": f"Question {index}: how long is river {index}?"}]
        body = {"model": MODEL, "messages": [system, *messages] if index % 4 == 0 else messages,
                "max_tokens": max_tokens, "temperature": 0}
        lines.append(json.dumps({"custom_id": f"q{index}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
        keys.append(f"q{index}")
    lines.append(json.dumps({"custom_id": "misspelt", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temprature": 0}}))
    lines.append("{not json")
    path.write_text("\n".join(lines) + "\n")
    return keys + ["misspelt"]


def batch(cluster: TwoNodeCluster, config: Path, source: Path, results: Path, *extra: str) -> subprocess.Popen:
    command = [str(Path(sys.executable).with_name("serve-app")), "batch", "-i", str(source), "-o", str(results),
               "--config", str(config), "--address", cluster.address, *extra]
    log = open(results.with_suffix(".log"), "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**users_environment(os.environ), **cluster.env})


def finished(run: subprocess.Popen, results: Path, timeout: float = 300) -> str:
    """The run's summary line, once it has exited."""
    assert run.wait(timeout=timeout) == 0, results.with_suffix(".log").read_text()[-3000:]
    return next(line for line in results.with_suffix(".log").read_text().splitlines() if " lines answered " in line)


def result_lines(results: Path) -> dict[str, list[dict]]:
    by_key: dict[str, list[dict]] = collections.defaultdict(list)
    for text in results.read_text().splitlines():
        line = json.loads(text)
        by_key[line["custom_id"] or line["id"]].append(line)
    return by_key


def wait_for_lines(results: Path, run: subprocess.Popen, timeout: float = 240) -> int:
    """Wait until the results file has some lines; how many."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if results.exists() and (count := len(results.read_text().splitlines())):
            return count
        assert run.poll() is None, results.with_suffix(".log").read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError("no results within the timeout")


def test_every_line_gets_one_result_and_both_nodes_engines_take_lines(cluster: TwoNodeCluster, config: Path, tmp_path: Path) -> None:
    keys = requests(tmp_path / "requests.jsonl", 96)
    results = tmp_path / "results.jsonl"
    summary = finished(batch(cluster, config, tmp_path / "requests.jsonl", results), results)
    assert summary.startswith("98 lines answered (2 failed)"), summary
    by_key = result_lines(results)
    assert len(by_key) == 98 and all(len(lines) == 1 for lines in by_key.values())
    assert set(keys) < set(by_key)
    for key in keys[:-1]:
        response = by_key[key][0]["response"]
        assert response["status_code"] == 200 and response["body"]["object"] == "chat.completion"
    assert by_key["misspelt"][0]["response"]["body"]["error"]["param"] == "temprature"
    (bad,) = [lines[0] for key, lines in by_key.items() if key not in keys]
    assert bad["error"]["code"] == "invalid_json"
    assert len(set(engine_task_nodes(cluster))) == 2


def engine_task_nodes(cluster: TwoNodeCluster) -> list[str]:
    """The nodes of the engine actors' finished tasks (blocks of lines), as Ray's state API lists them."""
    script = (
        "import json, sys; from ray.util.state import list_tasks; "
        f"tasks = list_tasks(address=sys.argv[1], filters=[('name', '=', {ENGINE_ACTOR_TASK!r}), ('state', '=', 'FINISHED')], limit=10000); "
        "print(json.dumps([task.node_id for task in tasks]))"
    )
    return json.loads(cluster.state(script))
