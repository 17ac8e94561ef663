"""Shared fixtures: the prepared default model, transformers' reference model, tiny random models."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from serve_app.config import DEFAULT_MODEL, default_cache_dir
from serve_app.engine import InferenceEngine
from serve_app.model.loader import resolve_model_path
from tests.references import ReferenceModel
from tests.tiny_models import build_tiny_model

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def model_path() -> Path:
    return resolve_model_path(DEFAULT_MODEL, default_cache_dir())


@pytest.fixture(scope="session")
def reference(model_path: Path) -> ReferenceModel:
    """transformers' own model (SDPA attention, its own KV cache) for the greedy oracle."""
    return ReferenceModel(model_path)


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    return build_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3"), tokenizer_from=model_path)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"), tokenizer_from=model_path)


def assert_no_leak(engine: InferenceEngine, free_before: int) -> None:
    """Every page (or slot) handed out has come back once the engine is idle."""
    stats = engine.get_stats()
    assert stats["active_tasks"] == 0 and stats["waiting_queue"] == 0, stats
    assert stats["kv_pages_free"] == free_before, stats


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[InferenceEngine]:
    """The default model on a paged cache with 16-token pages."""
    eng = InferenceEngine(model=str(model_path), kv_cache="paged", page_size=16, cache_tokens=8192, max_model_len=2048)
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def _engine_returns_every_page(request: pytest.FixtureRequest) -> Iterator[None]:
    """After any test that used the shared `engine`, its free pages are back at their starting value."""
    if "engine" not in request.fixturenames:
        yield
        return
    eng: InferenceEngine = request.getfixturevalue("engine")
    before = eng.get_stats()["kv_pages_free"]
    yield
    wait_idle(eng)
    assert_no_leak(eng, before)


def wait_idle(engine: InferenceEngine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.get_stats()
        if stats["active_tasks"] == 0 and stats["waiting_queue"] == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine still busy after {timeout} s: {engine.get_stats()}")
