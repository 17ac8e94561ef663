"""Processes the end-to-end tests find and start: the engine replica of a `serve run`, a two-node Ray cluster."""

from __future__ import annotations

import json
import os
import random
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families

from serve_app.bench.idle import wait_idle
from serve_app.bench.servers import ROOT, free_port, users_environment
from tests.inprocess import MODEL, openai_client

# How long the request router of the tests' `serve run`s follows the replica board after its last request.
FOLLOWER_IDLE_S = 2.0


def router_config(**kwargs: float) -> dict:
    """The engine's `request_router_config` of serve_config.yaml, with these `request_router_kwargs` changed."""
    app = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]
    config = app["args"]["llm_configs"][0]["deployment_config"]["request_router_config"]
    return {**config, "request_router_kwargs": {**config["request_router_kwargs"], **kwargs}}


def routing_reports(url: str) -> dict[str, dict[str, float]]:
    return httpx.get(f"{url}/stats/routing", timeout=10).json()


def _wait_for_report(url: str, condition, what: str, timeout: float = 30.0) -> dict[str, dict[str, float]]:
    deadline = time.monotonic() + timeout
    while True:
        reports = routing_reports(url)
        if any(condition(name, report) for name, report in reports.items()):
            return reports
        if time.monotonic() > deadline:
            raise AssertionError(f"no router reported {what} within {timeout} s: {reports}")
        time.sleep(0.25)


def check_routing_across_an_idle_spell(url: str) -> None:
    """A request is routed and answered, its router learns its pages from the board; after FOLLOWER_IDLE_S
    without requests the router stops following the board, and the next request (routed at once, from
    what the router knows) restarts its follower, which catches up."""
    client = openai_client(url)
    system = "You answer questions about the weather in the mountains, briefly and kindly. " * 6

    def ask(question: str) -> None:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, timeout=60)
        assert reply.choices[0].finish_reason in ("stop", "length")

    ask("Is it windy?")
    reports = _wait_for_report(url, lambda _, r: r["pages_known"] > 0, "the pages of a routed request")
    starts = {name: report["follower_starts"] for name, report in reports.items()}
    time.sleep(FOLLOWER_IDLE_S + 2.0)  # idle past the follower's patience, and its last wait at the board
    ask("Is it cold?")
    _wait_for_report(
        url, lambda name, r: r["follower_starts"] > starts.get(name, 0) and r["pages_known"] > 0,
        "a restarted follower that caught up",
    )


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _engine_replicas_under(root_pid: int) -> list[psutil.Process]:
    """The engine replicas' processes among the descendants of `root_pid`."""
    found = []
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            if "ServeReplica:llm:EngineDeployment" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


def engine_replica_pid(served_pid: int) -> int:
    """The engine replica's process among the descendants of a `serve run` process."""
    replicas = _engine_replicas_under(served_pid)
    assert replicas, "no engine replica process found under serve run"
    return replicas[0].pid


class TwoNodeCluster:
    """A Ray cluster of two nodes on this machine, started as a user starts one: `ray start --head --block`
    (with its dashboard, which `serve deploy` talks to), then `ray start --address=... --block` for the
    second raylet, one CPU each. The second has a resource of its own (`worker_node`), a model cache folder
    of its own (`SERVE_APP_CACHE_DIR`) and, as a machine of its own would, does not see `head_only` (a
    folder of the head's): it runs in a mount namespace of its own with an empty tmpfs over it. Token
    authentication is on: every process that joins reads the cluster's token file (`RAY_AUTH_MODE=token`,
    `RAY_AUTH_TOKEN_PATH`), as another machine would after `ray get-auth-token` was copied to it."""

    def __init__(self, workdir: Path, head_only: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{free_port()}"
        token = workdir / "auth_token"
        token.write_text(secrets.token_hex(32))
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
        self.worker_cache = workdir / "worker-node-cache"
        self._temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        ray = str(Path(sys.executable).parent / "ray")
        environ = {**users_environment(os.environ), **self.env}
        self._logs = [open(workdir / "head.log", "w"), open(workdir / "worker.log", "w")]
        self.head = subprocess.Popen(
            [ray, "start", "--head", f"--port={self.port}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard.rsplit(':', 1)[1]}",
             f"--ray-client-server-port={free_port()}", f"--temp-dir={self._temp_dir}", "--block"],
            stdout=self._logs[0], stderr=subprocess.STDOUT, start_new_session=True, env=environ,
        )
        deadline = time.monotonic() + 120
        while not _listening(self.port):
            if self.head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start --head did not come up: {(workdir / 'head.log').read_text()[-2000:]}")
            time.sleep(0.2)
        join = [ray, "start", f"--address={self.address}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                '--resources={"worker_node": 1}', "--block"]
        # Root makes a mount namespace; anyone else a user namespace first, mapped to root inside it.
        namespace = ["unshare", "--mount", "--propagation", "private"] if os.geteuid() == 0 else [
            "unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]
        hide = f"mount -t tmpfs none {shlex.quote(str(head_only))} && exec {shlex.join(join)}"
        self.worker = subprocess.Popen(
            [*namespace, "sh", "-c", hide],
            stdout=self._logs[1], stderr=subprocess.STDOUT, start_new_session=True,
            env={**environ, "SERVE_APP_CACHE_DIR": str(self.worker_cache)},
        )

    def state(self, script: str, timeout: float = 60) -> str:
        """What `script` (Python, given the dashboard's address as `sys.argv[1]`) prints, run as a process that
        joins this cluster with its token, as a user's would."""
        listed = subprocess.run(
            [sys.executable, "-c", script, self.dashboard], capture_output=True, text=True, timeout=timeout,
            env={**users_environment(os.environ), **self.env}, check=True,
        )
        return listed.stdout.strip().splitlines()[-1]

    def wait_for_both_nodes(self, timeout: float = 120) -> None:
        """Until the second raylet has joined: both nodes alive in Ray's state."""
        script = (
            "import sys, time; from ray.util.state import list_nodes\n"
            "def alive():\n"
            "    try:\n"
            "        return len(list_nodes(address=sys.argv[1], filters=[('state', '=', 'ALIVE')]))\n"
            "    except Exception:  # the dashboard not up yet\n"
            "        return 0\n"
            f"deadline = time.monotonic() + {timeout}\n"
            "while alive() < 2:\n"
            "    assert time.monotonic() < deadline, 'the second node did not join'\n"
            "    time.sleep(0.5)\n"
            "print('joined')"
        )
        self.state(script, timeout + 30)

    def serve_cli(self, *args: str, token: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """A `serve` command against this cluster's dashboard, in a user's environment with the cluster's
        token (or the one in `token`)."""
        serve = str(Path(sys.executable).parent / "serve")
        auth = {**self.env, **({"RAY_AUTH_TOKEN_PATH": str(token)} if token else {})}
        return subprocess.run(
            [serve, *args, "--address", self.dashboard], capture_output=True, text=True, timeout=timeout,
            env={**users_environment(os.environ), **auth},
        )

    def engine_replicas(self) -> list[tuple[str, psutil.Process]]:
        """The engine replicas' processes, each with the node it runs on ("head" or "worker")."""
        nodes = (("head", self.head), ("worker", self.worker))
        return [(node, proc) for node, root in nodes for proc in _engine_replicas_under(root.pid)]

    def stop(self) -> None:
        """Stop the two raylets this cluster started, each by its own process group (a head's `ray start
        --block` outlives a SIGTERM to its group by more than half a minute: it gets 5 s, then SIGKILL)."""
        for process in (self.worker, self.head):
            for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 20)):
                try:
                    os.killpg(process.pid, sig)
                    process.wait(timeout=grace)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        for log in self._logs:
            log.close()
        shutil.rmtree(self._temp_dir, ignore_errors=True)


@dataclass(frozen=True)
class MetricSamples:
    """Every sample of a `/metrics` text: (name, labels, value)."""

    samples: list[tuple[str, dict[str, str], float]]

    def total(self, name: str, **labels: str) -> float:
        """The sum of the samples named `name` whose labels include `labels` (over models and replicas)."""
        return sum(value for n, have, value in self.samples if n == name and labels.items() <= have.items())

    def labels(self, name: str) -> list[dict[str, str]]:
        return [have for n, have, _ in self.samples if n == name]

    def names(self) -> set[str]:
        return {n for n, _, _ in self.samples}


def metric_samples(url: str) -> MetricSamples:
    """Every sample of `/metrics`, e.g. `.total("serve_app:request_success_total", finished_reason="length")`."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return MetricSamples([
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ])


def settled_metric_samples(url: str, name: str, heartbeat_s: float, timeout: float = 30.0) -> MetricSamples:
    """`/metrics` once `name`'s total has stopped moving for two engine heartbeats: the board's copy of each
    engine's counters has caught up with the requests already answered."""
    deadline = time.monotonic() + timeout
    last = metric_samples(url)
    while True:
        time.sleep(2.5 * heartbeat_s)
        now = metric_samples(url)
        if now.total(name) == last.total(name) or time.monotonic() > deadline:
            return now
        last = now


def ray_metric_samples(ray_dir: str) -> MetricSamples:
    """Every sample Ray's metrics agents export for the cluster whose temp dir is `ray_dir` (the targets of
    its Prometheus service-discovery file), e.g. `ray_serve_app_request_success_total`."""
    targets = []
    for path in Path(ray_dir).glob("**/prom_metrics_service_discovery.json"):
        for entry in json.loads(path.read_text()):
            targets += entry["targets"]
    samples: dict[tuple, tuple[str, dict[str, str], float]] = {}
    for target in sorted(set(targets)):
        try:
            text = httpx.get(f"http://{target}/metrics", timeout=10).text
        except httpx.HTTPError:
            continue  # an agent still starting
        for family in text_string_to_metric_families(text):
            for sample in family.samples:  # a sample more than one endpoint serves counts once
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = (sample.name, dict(sample.labels), sample.value)
    return MetricSamples(list(samples.values()))


def random_ids(seed: int, count: int) -> list[int]:
    """`count` token ids, the same for the same seed: a prompt no other test shares."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(count)]


def greedy_completion(url: str, ids: list[int], salt: str | None = None, wait_idle_after: bool = True) -> tuple[str, int]:
    """Greedy text (12 tokens) and cached prompt tokens of one completion of `ids`, by default once the
    server's engines are idle again (every page they published written to their KV tiers)."""
    reply = openai_client(url).completions.create(
        model=MODEL, prompt=ids, max_tokens=12, temperature=0, timeout=300,
        extra_body={"ignore_eos": True, **({"cache_salt": salt} if salt else {})},
    )
    if wait_idle_after:
        wait_idle(lambda: httpx.get(f"{url}/stats", timeout=10).json(), timeout=120)
    return reply.choices[0].text, reply.usage.prompt_tokens_details.cached_tokens
