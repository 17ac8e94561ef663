"""The project's `serve run`, shared by the end-to-end tests, and a Ray cluster it must keep away from."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from serve_app.bench.servers import free_port


class ForeignRayCluster:
    """A one-node Ray cluster on loopback (`ray start --head --block`) that is not ours to join."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self._log = open(log_path, "w")
        ray = Path(sys.executable).parent / "ray"
        self.process = subprocess.Popen(
            [str(ray), "start", "--head", f"--port={self.port}", "--node-ip-address=127.0.0.1", "--num-cpus=0",
             "--include-dashboard=false", f"--ray-client-server-port={free_port()}", f"--temp-dir={self._temp_dir}",
             "--block"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + 120
        while not _listening(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start did not come up: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)

    def process_names(self) -> list[str]:
        """The command lines of every process the cluster runs."""
        names = []
        for proc in psutil.Process(self.process.pid).children(recursive=True):
            try:
                names.append(" ".join(proc.cmdline()))
            except psutil.NoSuchProcess:
                continue
        return names

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(timeout=10)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        self._log.close()
        shutil.rmtree(self._temp_dir, ignore_errors=True)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def engine_replica_pid(served_pid: int) -> int:
    """The engine replica's process among the descendants of a `serve run` process."""
    for proc in psutil.Process(served_pid).children(recursive=True):
        try:
            if "ServeReplica:llm:EngineDeployment" in " ".join(proc.cmdline()):
                return proc.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("no engine replica process found under serve run")


class TwoNodeCluster:
    """A Ray cluster of two nodes on this machine: a head and a worker raylet, one CPU each, both started
    with the environment a `serve run` of the project gets (`serve_env`)."""

    def __init__(self, workdir: Path) -> None:
        from serve_app.bench.servers import serve_env

        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Token authentication, as Ray sets up a cluster by default, for every process that joins it,
        # with a token of the cluster's own (none need be in ~/.ray on a fresh machine).
        self.env = {**serve_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self._temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        ray = str(Path(sys.executable).parent / "ray")
        environ = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **self.env}
        self._logs = [open(workdir / "head.log", "w"), open(workdir / "worker.log", "w")]
        self.head = subprocess.Popen(
            [ray, "start", "--head", f"--port={self.port}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
             "--include-dashboard=false", f"--ray-client-server-port={free_port()}", f"--temp-dir={self._temp_dir}",
             "--block"],
            stdout=self._logs[0], stderr=subprocess.STDOUT, start_new_session=True, env=environ,
        )
        deadline = time.monotonic() + 120
        while not _listening(self.port):
            if self.head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start --head did not come up: {(workdir / 'head.log').read_text()[-2000:]}")
            time.sleep(0.2)
        self.worker = subprocess.Popen(
            [ray, "start", f"--address={self.address}", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--block"],
            stdout=self._logs[1], stderr=subprocess.STDOUT, start_new_session=True, env=environ,
        )

    def engine_replica_pids(self) -> list[int]:
        """The engine replicas' processes, on either node."""
        pids = []
        for root in (self.head, self.worker):
            for proc in psutil.Process(root.pid).children(recursive=True):
                try:
                    if "ServeReplica:llm:EngineDeployment" in " ".join(proc.cmdline()):
                        pids.append(proc.pid)
                except psutil.NoSuchProcess:
                    continue
        return pids

    def stop(self) -> None:
        for process in (self.worker, self.head):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(process.pid, sig)
                    process.wait(timeout=20)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        for log in self._logs:
            log.close()
        shutil.rmtree(self._temp_dir, ignore_errors=True)
