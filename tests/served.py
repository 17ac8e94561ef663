"""The project's `serve run`, shared by the end-to-end tests, and a Ray cluster it must keep away from."""

from __future__ import annotations

import os
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
