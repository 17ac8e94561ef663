"""Batches on a two-node Ray cluster started first (`ray start`), as a user runs them. `serve-app batch`: every
line gets exactly one result line, both nodes' engines take lines, a killed engine actor loses none, and a run
killed midway resumes with only the lines it had not answered. Ray Data LLM's processors: against the app's
engine deployment and its ingress (the README's example). OpenAI's Batch API through the app's ingress, its
engine replica killed midway."""

from __future__ import annotations

import collections
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
import yaml
from openai.types.chat import ChatCompletion

from serve_app.bench.servers import ROOT, ServeRun, users_environment
from tests.served import TwoNodeCluster

MODEL = "tiny-llama"
ENGINE_ACTOR_TASK = "MapWorker(MapBatches(BatchEngine)).submit"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, head_only: Path) -> Iterator[TwoNodeCluster]:
    nodes = TwoNodeCluster(tmp_path_factory.mktemp("batch-cluster"), head_only)
    try:
        nodes.wait_for_both_nodes()
        yield nodes
    finally:
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


def engine_actor_processes() -> list[psutil.Process]:
    """The engine actors' worker processes (Ray titles a worker after the actor it runs)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any("MapBatches(BatchEngine)" in part for part in process.info["cmdline"] or []):
            found.append(process)
    return found


def test_a_killed_engine_actor_loses_no_line(cluster: TwoNodeCluster, config: Path, tmp_path: Path) -> None:
    keys = requests(tmp_path / "requests.jsonl", 480, max_tokens=48)
    results = tmp_path / "results.jsonl"
    earlier = {actor.pid for actor in engine_actor_processes()}  # an earlier run's actors may not have exited yet
    run = batch(cluster, config, tmp_path / "requests.jsonl", results)
    written = wait_for_lines(results, run)
    actors = [actor for actor in engine_actor_processes() if actor.pid not in earlier]  # this run's
    assert actors and written < len(keys)
    actors[0].kill()  # mid-batch: the rest of its blocks are in flight
    summary = finished(run, results)
    assert summary.startswith("482 lines answered (2 failed)"), summary
    by_key = result_lines(results)
    assert len(by_key) == 482 and all(len(lines) == 1 for lines in by_key.values())
    assert all(by_key[key][0]["response"]["status_code"] == 200 for key in keys[:-1])
    # The actor killed was this run's and is gone. Whether Ray restarts it before the run ends is Ray's timing: in
    # some runs the surviving actor answered its blocks first and no restart was recorded.
    actors[0].wait(timeout=30)  # gone (psutil's TimeoutExpired where it is not)


def test_a_run_killed_midway_resumes_with_the_lines_it_had_not_answered(
    cluster: TwoNodeCluster, config: Path, tmp_path: Path
) -> None:
    keys = requests(tmp_path / "requests.jsonl", 480, max_tokens=48)
    results = tmp_path / "results.jsonl"
    run = batch(cluster, config, tmp_path / "requests.jsonl", results)
    wait_for_lines(results, run)
    run.send_signal(signal.SIGKILL)
    run.wait(timeout=30)
    before = result_lines(results)
    assert 0 < len(before) < 482 and all(len(lines) == 1 for lines in before.values())
    summary = finished(batch(cluster, config, tmp_path / "requests.jsonl", results), results)
    assert summary.startswith(f"{482 - len(before)} lines answered (")
    assert f"{len(before)} answered before" in summary
    by_key = result_lines(results)
    assert len(by_key) == 482 and all(len(lines) == 1 for lines in by_key.values())
    assert all(by_key[key][0]["response"]["status_code"] == 200 for key in keys[:-1])


@pytest.fixture(scope="module")
def app(cluster: TwoNodeCluster, tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeRun]:
    """The app, by `serve run` on the cluster, serving the tiny model (its engine on half a CPU: Ray Data LLM's
    stages need the rest)."""
    run = ServeRun(
        tmp_path_factory.mktemp("batch-app"), address=cluster.address, proxy_location="HeadOnly", env=cluster.env,
        models=[{"model_loading_config": {"model_id": MODEL, "model_source": str(tiny_llama_path)}}],
        engine_kwargs={"compile": False, "cache_tokens": 8192, "max_model_len": 1024},
        engine_deployment={"ray_actor_options": {"num_cpus": 0.5}}, plain=True,
        args={"batch_files_path": str(tmp_path_factory.mktemp("batch-files"))},
    )
    yield run
    run.stop()


def user_script(cluster: TwoNodeCluster, *command: str) -> list[dict]:
    """The JSON lines a user's Ray Data script prints, run on the cluster."""
    done = subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**users_environment(os.environ), **cluster.env, "RAY_ADDRESS": cluster.address},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_ray_data_llm_processors_reach_the_engine_deployment_and_the_ingress(cluster: TwoNodeCluster, app: ServeRun) -> None:
    rows = user_script(cluster, "examples/ray_data_llm.py", "--model", MODEL, "--url", app.url)
    for processor, prefix in (("serve_deployment", "chatcmpl-"), ("http_request", "chatcmpl-")):
        answers = [row for row in rows if row["processor"] == processor]
        assert len(answers) == 4 and all(row["id"].startswith(prefix) and isinstance(row["answer"], str) for row in answers)


def test_a_request_the_api_refuses_is_a_row_error_through_the_engine_deployment(cluster: TwoNodeCluster, app: ServeRun) -> None:
    script = f"""
import json, ray
from ray.data.llm import ServeDeploymentProcessorConfig, build_processor
processor = build_processor(
    ServeDeploymentProcessorConfig(deployment_name="EngineDeployment:{MODEL}", app_name="llm", batch_size=4, concurrency=1,
                                   should_continue_on_error=True),
    preprocess=lambda row: {{"method": "completions", "request_kwargs": {{"model": "{MODEL}", "prompt": "Once upon a time",
                            "max_tokens": row["max_tokens"], "temperature": 0}}}},
)
for row in processor(ray.data.from_items([{{"max_tokens": 4}}, {{"max_tokens": -1}}, {{"max_tokens": 6}}])).take_all():
    print(json.dumps({{"error": row["__inference_error__"], "usage": row.get("usage")}}, default=str))
"""
    rows = user_script(cluster, "-c", script)
    assert len(rows) == 3
    (refused,) = [row for row in rows if row["error"]]
    assert "400" in refused["error"] and "max_tokens" in refused["error"]
    assert sorted(row["usage"]["completion_tokens"] for row in rows if not row["error"]) == [4, 6]


def test_a_batch_api_batch_loses_no_line_to_a_killed_engine_replica(cluster: TwoNodeCluster, app: ServeRun) -> None:
    """The OpenAI SDK's batch round trip through the app's ingress; the engine replica killed midway: Serve
    replaces it, and the lines it was answering are answered again, each once."""
    oai = openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0, timeout=60)
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 64,
                       "temperature": 0}} for i in range(48)]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    file_id = oai.files.create(file=("requests.jsonl", io.BytesIO(text.encode())), purpose="batch").id
    batch = oai.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (seen := oai.batches.retrieve(batch.id)).request_counts.completed == 0:
        assert seen.status in ("validating", "in_progress") and time.monotonic() < deadline, seen
        time.sleep(0.1)
    assert seen.request_counts.completed < 48, "the batch ended before the replica could be killed"
    (victim,) = [process for _, process in cluster.engine_replicas()]
    victim.kill()
    while (batch := oai.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline + 300, batch
        time.sleep(0.5)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (48, 0)
    answered = [json.loads(line) for line in oai.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in answered) == sorted(f"q{i}" for i in range(48))
    assert all(ChatCompletion.model_validate(line["response"]["body"]).choices[0].finish_reason for line in answered)
    assert oai.files.content(batch.error_file_id).text == ""
    assert victim.pid not in [process.pid for _, process in cluster.engine_replicas()]  # its replacement answered
