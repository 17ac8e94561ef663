"""`serve-app bench compare`: every system over the same prompts in one run, side by side, as ratios.

Each in-process system runs in a fresh subprocess (its own memory peak, no shared state); the
HTTP systems are a real `serve run` (`http`, the shipped config, compiled; `http-fp32` with the float32 weights
rather than the packaged GGUF's blocks; `http-int8` and `http-int4`
with int8 and 4-bit weights; `-kv16` with a bfloat16 KV cache; `-eager` without the compiled forward) and llama.cpp's
`llama-server` on each GGUF given (`llama-server:<file stem>`), loaded by one async client from this
process. The HTTP systems run each workload asked for on one start: `completions`, the same token-id
prompts streamed through this server's `/v1/completions` and llama-server's `/completion`, and `chat`,
short chats streamed through each server's `/v1/chat/completions` and its own chat template (rows
`<system> chat`). The engine and the HTTP systems alternate by concurrency
(`plan_runs`), and the host's matmul rate is measured before every run, because a shared host's
speed drifts (here 150-296 GFLOP/s within one run). The report names the CPU (model, cores, flags: its JSON keeps
every flag), since which kernels win differs by host.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from serve_app.bench.hardware import CpuInfo, decode_ceiling_tok_s, matmul_gflops
from serve_app.bench.prompts import make_prompts
from serve_app.bench.stats import BenchRow, format_table

# `serve run` with these engine args on top of serve_config.yaml's.
HTTP_SYSTEMS = {
    "http": {},
    "http-fp32": {"quantization": "none"},
    "http-int8": {"quantization": "int8"},
    "http-int4": {"quantization": "int4"},
    "http-kv16": {"kv_cache_dtype": "bfloat16"},
    "http-int4-kv16": {"quantization": "int4", "kv_cache_dtype": "bfloat16"},
    "http-eager": {"compile": False},
    "http-int8-eager": {"quantization": "int8", "compile": False},
}
SYSTEMS = ("engine", "hf-sequential", "hf-static", "hf-generate-batch", *HTTP_SYSTEMS, "llama-server")
# Run level by level, alternating, so that their ratios compare runs minutes apart.
SERVED = ("engine", *HTTP_SYSTEMS)
LLAMA = "llama-server"
WORKLOADS = ("completions", "chat")


def _token_prompts(model_path: Path, count: int, seed: int) -> list[list[int]]:
    from serve_app.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_path)
    return [tokenizer.encode(p) for p in make_prompts(count, seed=seed)]


def worker(argv: list[str]) -> None:
    """Run one in-process system (in this fresh process) and write its rows and tokens as JSON."""
    from serve_app.bench import systems

    parser = argparse.ArgumentParser()
    parser.add_argument("system")
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--prompt-file", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1])
    parser.add_argument("--single-client-requests", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    prompts = json.loads(args.prompt_file.read_text())
    placement = systems.Placement(args.device, args.dtype)
    if args.system == "engine":
        result = systems.run_engine(
            str(args.model_path), prompts, args.concurrency, args.max_tokens, args.single_client_requests, placement
        )
    elif args.system == "hf-sequential":
        result = systems.run_hf_sequential(args.model_path, prompts, args.max_tokens, placement)
    elif args.system == "hf-static":
        result = systems.run_hf_static(args.model_path, prompts, args.max_tokens, placement)
    else:
        result = systems.run_hf_generate_batch(args.model_path, prompts, args.max_tokens, placement)
    args.out.write_text(json.dumps({"rows": [asdict(r) for r in result.rows], "tokens": result.tokens}))


def _workload_of(row_system: str) -> tuple[str, str]:
    """A row's system and workload: `http chat` is `http` on the chat workload."""
    system, _, workload = row_system.partition(" ")
    return system, workload or "completions"


def _is_llama(system: str) -> bool:
    """llama-server on one of the GGUF files (`llama-server:<stem>`)."""
    return system.startswith(f"{LLAMA}:")


def _served(system: str) -> bool:
    return system in SERVED or _is_llama(system)


def plan_runs(systems: Sequence[str], concurrencies: Sequence[int]) -> list[tuple[str, list[int]]]:
    """The runs in order, each a system and its concurrency levels.

    With two or more of the engine and the HTTP systems, they alternate level by level (the
    engine at C, then each HTTP system at C, each fresh), so every ratio between them compares
    runs minutes apart on a host whose speed drifts; the other systems follow, each over every
    level at once.
    """
    served = [s for s in systems if _served(s)]
    paired = served if len(served) > 1 else []
    runs = [(system, [c]) for c in concurrencies for system in paired]
    return runs + [(s, list(concurrencies)) for s in systems if s not in paired]


def _run_worker(
    system: str, model_path: Path, prompts: list[list[int]], concurrency: list[int], args: argparse.Namespace, tmp: Path
):
    prompt_file = tmp / f"{system}-prompts.json"
    prompt_file.write_text(json.dumps(prompts))
    out = tmp / f"{system}.json"
    command = [
        sys.executable, "-m", "serve_app.bench.compare", "--worker", system, "--model-path", str(model_path),
        "--prompt-file", str(prompt_file), "--max-tokens", str(args.max_tokens), "--out", str(out),
        "--single-client-requests", str(args.single_client_requests), "--device", args.device, "--dtype", args.dtype,
        "--concurrency", *map(str, concurrency),
    ]
    levels = f" at concurrency {','.join(map(str, concurrency))}" if system == "engine" else ""
    print(f"running {system}{levels} ...", flush=True)
    subprocess.run(command, check=True)
    data = json.loads(out.read_text())
    return [BenchRow(**row) for row in data["rows"]], data["tokens"]


def _chats(count: int, seed: int) -> list[list[dict[str, str]]]:
    """The chat workload: short single-turn questions."""
    return [[{"role": "user", "content": p}] for p in make_prompts(count, seed=seed, long_every=0)]


def _run_http(
    system: str, prompts: list[list[int]], concurrency: list[int], args: argparse.Namespace, tmp: Path,
    gguf: Path | None,
) -> list[BenchRow]:
    """One start of an HTTP system, every workload asked for on it."""
    from serve_app.bench.servers import LlamaServer, ServeRun, served_id
    from serve_app.bench.systems import run_http

    print(f"starting {system} for concurrency {','.join(map(str, concurrency))} ...", flush=True)
    if gguf is not None:
        server = LlamaServer(Path(args.llama_server), gguf, tmp)
    else:
        server = ServeRun(tmp, engine_kwargs={"max_model_len": 2048, **HTTP_SYSTEMS[system]}, timeout=1200, model=args.model)
    peak = [server.rss_mb()]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            peak[0] = max(peak[0], server.rss_mb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rows: list[BenchRow] = []
    try:
        llama = gguf is not None
        served = served_id(args.model) if llama else server.model_id  # llama-server answers any name
        if "completions" in args.workloads:
            rows += run_http(
                server.url, served, prompts, concurrency, args.max_tokens, args.single_client_requests, system=system,
                api="llama.cpp" if llama else "openai", close_connections=llama,
            )
        if "chat" in args.workloads:
            rows += run_http(
                server.url, served, _chats(args.requests, args.seed), concurrency, args.max_tokens,
                args.single_client_requests, system=f"{system} chat", api="chat", close_connections=llama,
            )
    finally:
        stop.set()
        sampler.join()
        server.stop()
    return [replace(row, peak_rss_mb=round(peak[0], 1)) for row in rows]


def main(args: argparse.Namespace) -> None:
    from serve_app.config import default_cache_dir
    from serve_app.model.loader import resolve_model_path

    systems = args.systems or [s for s in SYSTEMS if s != LLAMA or args.llama_server]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        sys.exit(f"serve-app bench compare: unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown or not args.workloads:
        sys.exit(f"serve-app bench compare: workloads are {', '.join(WORKLOADS)}; not {sorted(unknown)}")
    if args.device != "cpu" and any(s.startswith("http") or s == LLAMA for s in systems):
        sys.exit("serve-app bench compare: the HTTP systems and llama-server run on the CPU only; drop --device")
    ggufs: dict[str, Path] = {}  # llama-server's systems, one per GGUF
    if LLAMA in systems:
        if not args.llama_server or not args.gguf:
            sys.exit("serve-app bench compare: llama-server needs --llama-server PATH and --gguf PATH")
        ggufs = {f"{LLAMA}:{Path(g).stem}": Path(g) for g in args.gguf}
        at = systems.index(LLAMA)
        systems[at : at + 1] = list(ggufs)
    model_path = resolve_model_path(args.model, default_cache_dir())
    prompts = _token_prompts(model_path, args.requests, args.seed)
    gflops = matmul_gflops()
    n_params = _parameter_count(model_path)
    ceiling = decode_ceiling_tok_s(gflops, n_params)
    rows: list[BenchRow] = []
    host_gflops: list[float] = []  # the matmul rate measured just before each row's run
    tokens: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="serve-app-bench-") as tmp:
        for system, concurrency in plan_runs(systems, args.concurrency):
            rate = matmul_gflops()
            if system.startswith("http") or _is_llama(system):
                run_rows = _run_http(system, prompts, concurrency, args, Path(tmp), ggufs.get(system))
            else:
                subset = prompts[: args.sequential_requests] if system == "hf-sequential" else prompts
                run_rows, run_tokens = _run_worker(system, model_path, subset, concurrency, args, Path(tmp))
                if len(run_tokens) >= len(tokens.get(system, [])):
                    tokens[system] = run_tokens
            print(format_table(run_rows), flush=True)  # as it comes: a run cut short still shows what it measured
            rows += run_rows
            host_gflops += [rate] * len(run_rows)
    report = _report(rows, host_gflops, tokens, gflops, n_params, ceiling, args)
    print(report["text"])
    if args.json:
        Path(args.json).write_text(json.dumps(report["json"], indent=2))
    if args.plot:
        from serve_app.bench.plot import plot_rows
        from serve_app.bench.servers import served_id

        title = (f"{served_id(args.model)}, {args.requests} prompts, {args.max_tokens} new tokens, greedy; "
                 f"{CpuInfo.here().summary()}, {time.strftime('%Y-%m-%d')}")
        plot_rows(rows, args.plot, title=title)
        print(f"plot written to {args.plot}")


def _parameter_count(model_path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_path / "model.safetensors"), framework="pt") as handle:
        return sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())


def _report(rows, host_gflops, tokens, gflops, n_params, ceiling, args) -> dict:
    cpu = CpuInfo.here()
    lines = [format_table(rows), "", f"CPU: {cpu.summary()}"]
    lines.append(f"fp32 matmul: {gflops:.0f} GFLOP/s; {n_params / 1e6:.0f}M parameters -> decode ceiling {ceiling:.0f} tok/s")
    lines.append("  (host matmul GFLOP/s measured again just before each run, to show drift)")
    for row, rate in zip(rows, host_gflops):
        lines.append(
            f"  {row.system:>18} c={row.concurrency:<4} {row.output_tok_s:8.1f} tok/s = "
            f"{row.output_tok_s / ceiling:6.1%} of the ceiling   host {rate:.0f} GFLOP/s"
        )
    best_engine = {r.concurrency: r for r in rows if r.system == "engine"}
    engine_top = max(best_engine.values(), key=lambda r: r.output_tok_s, default=None)
    ratios = {}
    if engine_top is not None:
        for peer in ("hf-sequential", "hf-static", "hf-generate-batch"):
            row = next((r for r in rows if r.system == peer), None)
            if row is not None and row.output_tok_s:
                ratios[f"engine/{peer}"] = round(engine_top.output_tok_s / row.output_tok_s, 2)
        for row in (r for r in rows if r.system in HTTP_SYSTEMS):  # the completions workload only
            same = best_engine.get(row.concurrency)
            if same is not None and same.output_tok_s:
                ratios[f"{row.system}/engine@c={row.concurrency}"] = round(row.output_tok_s / same.output_tok_s, 2)
                # The single-client target: HTTP TTFT within 1.2x the in-process TTFT plus 20 ms (<= 1 passes).
                ratios[f"{row.system} ttft p50 / (1.2 x engine ttft p50 + 20 ms) @c={row.concurrency}"] = round(
                    row.ttft_p50_s / (1.2 * same.ttft_p50_s + 0.02), 3
                )
    for ours in (r for r in rows if _workload_of(r.system)[0] in HTTP_SYSTEMS):
        workload = _workload_of(ours.system)[1]
        for peer in rows:
            name, peer_workload = _workload_of(peer.system)
            if not (_is_llama(name) and peer_workload == workload and peer.concurrency == ours.concurrency):
                continue
            if peer.output_tok_s:
                ratios[f"{ours.system}/{peer.system}@c={ours.concurrency}"] = round(ours.output_tok_s / peer.output_tok_s, 2)
    lines.append("")
    lines += [f"{name}: {value}" for name, value in ratios.items()]
    oracle = None
    if "engine" in tokens and "hf-sequential" in tokens:
        reference = tokens["hf-sequential"]
        equal = sum(a == b for a, b in zip(tokens["engine"], reference))
        oracle = {"equal": equal, "compared": len(reference)}
        lines.append(f"greedy tokens equal to transformers (one at a time): {equal}/{len(reference)} prompts")
    payload = {
        "cpu": asdict(cpu),
        "prompts": args.requests,
        "max_tokens": args.max_tokens,
        "matmul_gflops": round(gflops, 1),
        "parameters": n_params,
        "decode_ceiling_tok_s": round(ceiling, 1),
        "rows": [
            asdict(r) | {"ceiling_fraction": round(r.output_tok_s / ceiling, 4), "host_gflops": round(rate, 1)}
            for r, rate in zip(rows, host_gflops)
        ],
        "ratios": ratios,
        "oracle": oracle,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    return {"text": "\n".join(lines), "json": payload}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
