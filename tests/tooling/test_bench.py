"""The benchmark tools: summaries, the engine bench, and a small `bench compare` run end to end."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serve_app import InferenceEngine
from serve_app.bench.compare import plan_runs
from serve_app.bench.hardware import CpuInfo
from serve_app.bench.engine_bench import run_engine_bench
from serve_app.bench.hardware import decode_ceiling_tok_s
from serve_app.bench.prompts import long_passage, make_prompts
from serve_app.bench.servers import (
    free_port,
    kill_haproxy_listening_on,
    real_haproxy_binary,
)
from serve_app.bench.stats import BenchRow, RequestTiming, percentile

ROW_FIELDS = {
    "system", "concurrency", "requests", "output_tokens", "duration_s", "output_tok_s",
    "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "peak_rss_mb",
}


def test_percentile_interpolates() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_row_from_timings() -> None:
    timings = [RequestTiming(0.1, (0.02, 0.04), 3), RequestTiming(0.3, (0.05,), 2)]
    row = BenchRow.from_timings("x", 2, 2.0, timings)
    assert row.output_tokens == 5 and row.output_tok_s == 2.5 and row.requests == 2
    assert row.ttft_p50_s == pytest.approx(0.2) and row.tpot_p50_s == pytest.approx(0.04)
    assert set(row.as_dict()) == ROW_FIELDS


def test_prompt_set_is_seeded_and_mixes_lengths(model_path: Path) -> None:
    from serve_app.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_path)
    prompts = make_prompts(8, seed=3)
    assert prompts == make_prompts(8, seed=3) and prompts != make_prompts(8, seed=4)
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    assert min(lengths) < 20 and 260 <= max(lengths) <= 340
    import random

    assert abs(len(tokenizer.encode(long_passage(tokenizer, 1000, random.Random(0)))) - 1000) <= 2


def test_decode_ceiling() -> None:
    assert decode_ceiling_tok_s(100.0, 50_000_000) == pytest.approx(1000.0)


def test_engine_bench_counts_every_token(tiny_llama_path: Path) -> None:
    engine = InferenceEngine(compile=False, model=str(tiny_llama_path), cache_tokens=4096)
    try:
        row, tokens = run_engine_bench(engine, make_prompts(6), 3, 5, return_tokens=True)
    finally:
        engine.shutdown()
    assert row.requests == 6 and row.output_tokens == 30 and all(len(t) == 5 for t in tokens)
    assert row.concurrency == 3 and row.output_tok_s > 0 and 0 < row.ttft_p50_s <= row.ttft_p99_s


def _start_haproxy(tmp_path: Path, port: int) -> subprocess.Popen:
    config = tmp_path / f"haproxy-{port}.cfg"
    config.write_text(
        "defaults\n  mode http\n  timeout connect 1s\n  timeout client 1s\n  timeout server 1s\n"
        f"frontend app\n  bind 127.0.0.1:{port}\n  http-request return status 200\n"
    )
    proc = subprocess.Popen([real_haproxy_binary(), "-db", "-f", str(config)], start_new_session=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"haproxy did not listen on {port}")


@pytest.fixture
def two_haproxies(tmp_path: Path) -> Iterator[tuple[int, subprocess.Popen, subprocess.Popen]]:
    port, other_port = free_port(), free_port()
    ours, other = _start_haproxy(tmp_path, port), _start_haproxy(tmp_path, other_port)
    yield port, ours, other
    for proc in (ours, other):
        proc.kill()
        proc.wait()


def test_kill_haproxy_ends_only_the_one_on_the_port(two_haproxies: tuple[int, subprocess.Popen, subprocess.Popen]) -> None:
    """What `ServeRun.stop` calls last ends a real HAProxy left on the run's port, and no other."""
    port, ours, other = two_haproxies
    assert kill_haproxy_listening_on(port) == 1
    ours.wait(timeout=10)
    assert other.poll() is None
    assert kill_haproxy_listening_on(port) == 0


def test_compare_alternates_engine_and_http_by_concurrency() -> None:
    systems = ["engine", "hf-static", "http"]
    assert plan_runs(systems, [1, 64]) == [
        ("engine", [1]), ("http", [1]), ("engine", [64]), ("http", [64]), ("hf-static", [1, 64]),
    ]
    assert plan_runs(["hf-static", "engine"], [1, 64]) == [("hf-static", [1, 64]), ("engine", [1, 64])]
    assert plan_runs(["http", "http-int8", "llama-server:q8"], [1, 64]) == [
        ("http", [1]), ("http-int8", [1]), ("llama-server:q8", [1]),
        ("http", [64]), ("http-int8", [64]), ("llama-server:q8", [64]),
    ]


def test_bench_compare_small_run(tmp_path: Path) -> None:
    """In-process systems in subprocesses, greedy tokens checked against one-at-a-time transformers."""
    out, plot = tmp_path / "compare.json", tmp_path / "compare.png"
    subprocess.run(
        [
            sys.executable, "-m", "serve_app.cli", "bench", "compare", "--requests", "4", "--max-tokens", "4",
            "--concurrency", "2", "--systems", "engine,hf-sequential,hf-static", "--sequential-requests", "2",
            "--json", str(out), "--plot", str(plot),
        ],
        check=True, timeout=600, capture_output=True,
    )
    report = json.loads(out.read_text())
    assert [r["system"] for r in report["rows"]] == ["engine", "hf-sequential", "hf-static"]
    assert all(ROW_FIELDS <= set(r) for r in report["rows"])
    assert all(r["host_gflops"] > 0 for r in report["rows"])
    assert report["rows"][0]["output_tokens"] == 16 and report["rows"][1]["requests"] == 2
    assert report["oracle"] == {"equal": 2, "compared": 2}
    assert report["matmul_gflops"] > 0 and report["decode_ceiling_tok_s"] > 0
    cpu = CpuInfo.here()  # the run names its CPU: model, flags, cores
    assert report["cpu"] == {"model": cpu.model, "flags": list(cpu.flags), "cores": cpu.cores} and cpu.model and cpu.flags
    assert set(report["ratios"]) == {"engine/hf-sequential", "engine/hf-static"}
    assert plot.stat().st_size > 10_000


def test_bench_structured_small_run(tmp_path: Path, tiny_llama_path: Path) -> None:
    """The same requests with and without a JSON schema; mask and compile costs measured."""
    out = tmp_path / "structured.json"
    subprocess.run(
        [
            sys.executable, "-m", "serve_app.cli", "bench", "structured", "--model", str(tiny_llama_path),
            "--requests", "4", "--concurrency", "2", "--max-tokens", "8", "--repeats", "1", "--json", str(out),
        ],
        check=True, timeout=600, capture_output=True,
    )
    report = json.loads(out.read_text())
    assert [r["system"] for r in report["rows"]] == ["unconstrained", "json-schema"]
    assert report["rows"][0]["output_tokens"] == 4 * 8 and 4 <= report["rows"][1]["output_tokens"] <= 4 * 8
    assert len(report["json_schema_over_unconstrained_tok_s"]) == 1
    assert report["mask_ms_per_step_at_2_rows"] > 0
    assert report["new_schema_s"] > report["cached_schema_s"] > 0 and report["first_load_s"] > 0


def test_process_cpu_names_each_process_and_charges_it_per_token() -> None:
    from serve_app.bench.process_cpu import Sample, costs, role_of

    assert role_of(["ray::ServeReplica:llm:Ingress"], "python") == "llm:Ingress"
    assert role_of(["ray::ServeController.listen_for_change"], "python") == "ServeController.listen_for_change"
    assert role_of(["/v/bin/python3", "-m", "serve_app.engine.child", "57", "59"], "python3") == "engine process"
    assert role_of(["/v/bin/python3", "-m", "deployments.engine_child", "57", "59"], "python3") == "engine process"
    assert role_of(["ray-dashboard-NodeHead-0 (/v/bin/python3 -c x)"], "python3") == "dashboard NodeHead"
    assert role_of(["/v/ray/core/src/ray/raylet/raylet", "--raylet_socket_name=x"], "raylet") == "raylet"
    assert role_of(["/v/bin/python3", "-u", "/v/ray/_private/log_monitor.py", "--x"], "python3") == "log_monitor.py"
    assert role_of(["/v/bin/python3", "/v/bin/serve", "run", "--address", "local", "c.yaml"], "python3") == "serve run"
    before = {1: Sample("engine process", 10.0, 100), 2: Sample("llm:Ingress", 1.0, 50), 3: Sample("raylet", 2.0, 7)}
    after = {1: Sample("engine process", 19.0, 110), 2: Sample("llm:Ingress", 1.2, 150), 4: Sample("haproxy", 0.5, 1)}
    rows = costs(before, after, tokens=100)
    assert [(r.role, r.pid) for r in rows] == [("engine process", 1), ("llm:Ingress", 2)]  # one gone, one new: neither
    assert abs(rows[0].cpu_ms_per_token - 90.0) < 1e-9 and abs(rows[1].cpu_ms_per_token - 2.0) < 1e-9
    assert rows[0].switches_per_token == 0.1 and rows[1].switches_per_token == 1.0


def test_memory_bench_splits_shared_pages_among_the_processes_of_a_tree() -> None:
    """A child holding 64 MiB of its own and sharing 32 MiB with this process: its own set counts the 64 MiB,
    its resident set the shared 32 MiB too, and its proportional set half of them."""
    from serve_app.bench.memory import measure

    script = (
        "import mmap, sys\n"
        "shared = mmap.mmap(int(sys.argv[1]), 32 << 20)\n"
        "shared.read(32 << 20)\n"  # touch every shared page
        "own = bytearray(b'x' * (64 << 20))\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    with tempfile.TemporaryFile() as backing:
        backing.truncate(32 << 20)
        mine = mmap.mmap(backing.fileno(), 32 << 20)
        mine.write(b"y" * (32 << 20))  # resident here too
        child = subprocess.Popen([sys.executable, "-c", script, str(backing.fileno())], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, pass_fds=(backing.fileno(),))
        try:
            assert child.stdout.readline().strip() == "ready"
            tree = measure("this test", os.getpid())
            row = next(r for r in tree.processes if r.pid == child.pid)
            assert 64 <= row.uss_mib < 64 + 24  # its bytearray and its interpreter's own pages
            assert row.rss_mib >= row.uss_mib + 32 - 1
            assert row.uss_mib + 15 <= row.pss_mib <= row.uss_mib + 17 + 8  # half the shared 32 MiB
            assert tree.pss_mib < tree.rss_mib and tree.processes[0].pss_mib >= tree.processes[-1].pss_mib
        finally:
            child.communicate("")
            mine.close()


def test_random_model_is_made_once_with_its_shape_and_the_embedded_tokenizer(tmp_path: Path, model_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from serve_app.bench.random_model import SHAPE, make_model
    from serve_app.model.tokenizer import Tokenizer

    small = {**SHAPE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16}
    folder = make_model(tmp_path / "tiny-random", 3, model_path, small)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (2, 64, 49152)
    chat = [{"role": "user", "content": "Hello there"}]  # its chat template too
    assert Tokenizer(folder).encode_chat(chat) == Tokenizer(model_path).encode_chat(chat)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert make_model(tmp_path / "tiny-random", 3, model_path, small) == folder  # made once
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    # The default shape is Llama 3.2 1B's decoder: about 1B parameters on this vocabulary.
    hidden, kv = SHAPE["hidden_size"], SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * SHAPE["intermediate_size"]
    assert 0.9e9 < SHAPE["num_hidden_layers"] * layer + 49152 * hidden < 1.2e9


def test_decode_kernel_bench_times_this_kernel_and_another_source_warm_and_cold(tmp_path: Path) -> None:
    """`--against` builds the other source too; every (round, kernel, pages' dtype, caches) gets a time, written to
    --json."""
    from serve_app.model.kernels.decode_kernel import SOURCE

    older = tmp_path / "older.c"
    older.write_text(SOURCE.read_text() + "\n/* another build of the same kernel */\n")
    report = tmp_path / "kernel.json"
    subprocess.run(
        [sys.executable, "-m", "serve_app.cli", "bench", "decode-kernel", "--rows", "4", "--context", "40",
         "--calls", "3", "--rounds", "1", "--against", str(older), "--kv-dtype", "float32,bfloat16", "--json",
         str(report)],
        check=True, timeout=300,
    )
    rows = json.loads(report.read_text())["rows"]
    assert sorted((r["kernel"], r["kv_dtype"], r["caches"]) for r in rows) == sorted(
        (name, dtype, caches) for name in ("this kernel", str(older)) for dtype in ("float32", "bfloat16")
        for caches in ("warm", "cold")
    )
    assert all(r["ms_per_call"] > 0 for r in rows)


def test_step_budget_splits_a_token_into_the_steps_parts_and_the_forwards_operators(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    """On a tiny model: the round holds the forward and the emitter; the operators' time is about the forward's at
    most, its matrix products among them."""
    report = tmp_path / "budget.json"
    subprocess.run(
        [sys.executable, "-m", "serve_app.cli", "bench", "step-budget", "--model", str(tiny_llama_path), "--no-compile",
         "--tokens", "16", "--requests", "1", "--json", str(report)],
        check=True, timeout=300,
    )
    budget = json.loads(report.read_text())
    assert len(budget["tpot_ms"]) == 1 and budget["tpot_ms"][0] > 0
    assert 0 < budget["forward_ms"] + budget["emit_ms"] <= budget["round_ms"]
    assert 0 < budget["operators_ms"] <= budget["forward_ms"] * 1.5  # the profiled rounds run a little slower
    assert any(op["name"] in ("aten::mm", "aten::addmm") for op in budget["operators"])
