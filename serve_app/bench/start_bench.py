"""`serve-app bench start`: how long `serve run` takes to its first answer, eager against compiled, the
compiled forward first with an empty compile cache (cold) and then with the one that start left (warm).

Every start is a fresh `serve run` of the shipped config (its own Ray cluster), timed from launch to the
first chat completion's answer. The compiled starts use a cache folder of their own
(`$SERVE_APP_CACHE_DIR`) that shares the prepared models and kernels of the real one but starts
without `compile/`; the starts alternate eager and compiled, so that drift on a shared host hits both.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from serve_app.bench.servers import ServeRun
from serve_app.config import default_cache_dir


def _shared_cache(real: Path, folder: Path) -> Path:
    """A cache folder holding links to every entry of `real` but its compile cache."""
    folder.mkdir(parents=True, exist_ok=True)
    for entry in real.iterdir():
        if entry.name != "compile":
            (folder / entry.name).symlink_to(entry)
    return folder


def time_start(workdir: Path, compile: bool, cache_dir: Path, model: str) -> dict:
    """Launch `serve run`, wait for the first chat answer; the seconds it took and what the engine reported."""
    started = time.perf_counter()
    server = ServeRun(
        workdir, engine_kwargs={"compile": compile}, env={"SERVE_APP_CACHE_DIR": str(cache_dir)}, timeout=1800, plain=True,
        model=model,
    )
    try:
        reply = httpx.post(
            f"{server.url}/v1/chat/completions", timeout=300,
            json={"model": server.model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        )
        reply.raise_for_status()
        seconds = time.perf_counter() - started
        stats = httpx.get(f"{server.url}/stats", timeout=30).json()
        return {
            "compile": compile, "seconds": round(seconds, 1), "compiled_forward": stats.get("compiled_forward"),
            "graphs_loaded": stats.get("compile_graphs_loaded"), "graphs_compiled": stats.get("compile_graphs_compiled"),
        }
    finally:
        server.stop()


def main(args) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp:
        root = Path(tmp)
        cache = _shared_cache(default_cache_dir(), root / "cache")
        runs = []
        for index, (label, compile) in enumerate(
            [("eager", False), ("compiled, cold cache", True)] + [("eager", False), ("compiled, warm cache", True)] * args.rounds
        ):
            workdir = root / f"run-{index}"
            workdir.mkdir()
            run = {"start": label, **time_start(workdir, compile, cache, args.model)}
            print(json.dumps(run), flush=True)
            runs.append(run)
    eager = statistics.median(r["seconds"] for r in runs if r["start"] == "eager")
    warm = statistics.median(r["seconds"] for r in runs if r["start"] == "compiled, warm cache")
    cold = next(r["seconds"] for r in runs if r["start"] == "compiled, cold cache")
    summary = {"eager_s": eager, "compiled_cold_s": cold, "compiled_warm_s": warm, "warm_over_eager": round(warm / eager, 2)}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=2))
