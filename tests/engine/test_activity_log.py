"""The engine's log: its start-up lines, one per fact, and the throughput line it prints every interval while
busy (and not while idle); the log level option."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from serve_app import GenerateRequest, InferenceEngine
from serve_app.engine.activity_log import activity_line


def test_the_activity_line_counts_what_moved_in_the_interval() -> None:
    before = {"prefill_tokens": 100, "total_tokens": 50, "prefix_cache_queried_tokens": 200, "prefix_cache_hit_tokens": 40}
    after = {
        "prefill_tokens": 300, "total_tokens": 150, "prefix_cache_queried_tokens": 400, "prefix_cache_hit_tokens": 190,
        "active_tasks": 3, "waiting_queue": 1, "kv_pages_total": 200, "kv_pages_free": 150,
    }
    assert activity_line(before, after, 2.0) == (
        "prompt throughput: 100.0 tokens/s, generation throughput: 50.0 tokens/s, running: 3 reqs, "
        "waiting: 1 reqs, KV cache usage: 25.0%, prefix cache hit rate: 75.0%"
    )
    idle = {**before, "active_tasks": 0, "waiting_queue": 0, "kv_pages_total": 200, "kv_pages_free": 200}
    assert activity_line(idle, idle, 10.0) is None


def test_an_engine_logs_its_start_and_its_throughput_while_busy(model_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="serve_app")
    engine = InferenceEngine(
        compile=False, model=str(model_path), kv_cache="paged", page_size=16, cache_tokens=2048, max_model_len=512,
        log_stats_interval_s=0.3, log_level="debug",
    )
    try:
        assert logging.getLogger("serve_app").level == logging.DEBUG
        started = [r.getMessage() for r in caplog.records if r.name == "serve_app.engine"]
        assert any(m.startswith("model: ") for m in started)
        assert "dtype: float32" in started
        assert "device: cpu" in started
        assert f"threads: {torch.get_num_threads()}" in started
        assert "KV cache: 128 pages of 16 tokens (paged)" in started
        assert "KV cache: 2048 tokens" in started
        assert any(m.startswith("maximum concurrent requests at full context (512 tokens): 4.00") for m in started)
        assert "compiled forward: off" in started
        caplog.clear()
        engine.generate_with_request(GenerateRequest(prompt="Count: one, two,", max_tokens=96, ignore_eos=True))
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prompt throughput: ")]
        assert lines, "no throughput line while generating"
        assert any("generation throughput: 0.0 tokens/s" not in line for line in lines)
    finally:
        engine.shutdown()
        logging.getLogger("serve_app").setLevel(logging.INFO)
