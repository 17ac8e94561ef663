"""Where the engine runs and how big its cache is: the device default (`$SERVE_APP_DEVICE`), the
cache's size on the CPU and its bounds on CUDA, and `bench gpu-check`'s device oracle, run here on
the CPU (on a CUDA host `make gpu-check` runs it there)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from serve_app.config import (
    DEFAULT_CACHE_TOKENS,
    DEVICE_ENV,
    CacheConfig,
    EngineConfig,
    ModelConfig,
)
from serve_app.kv.factory import cache_tokens
from serve_app.kv.storage import KVShape

SHAPE = KVShape(n_layers=30, n_kv_heads=3, head_dim=64, dtype=torch.float32)


def test_the_device_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ModelConfig().device == "cpu"  # the tests pin it (conftest)
    monkeypatch.setenv(DEVICE_ENV, "cuda:1")
    assert ModelConfig().device == "cuda:1"
    assert ModelConfig(device="cpu").device == "cpu"  # a config that names one wins
    assert EngineConfig.from_options(device="cuda").model.device == "cuda"
    monkeypatch.delenv(DEVICE_ENV)
    assert ModelConfig().device == "auto"


def test_the_cache_is_sized_in_tokens_in_bytes_or_by_default_on_the_cpu() -> None:
    cpu = torch.device("cpu")
    assert cache_tokens(CacheConfig(), SHAPE, cpu) == DEFAULT_CACHE_TOKENS
    assert cache_tokens(CacheConfig(num_tokens=100), SHAPE, cpu) == 100
    assert cache_tokens(CacheConfig(num_bytes=10 * SHAPE.bytes_per_token + 1), SHAPE, cpu) == 10
    assert cache_tokens(CacheConfig(num_tokens=7, num_bytes=10**9), SHAPE, cpu) == 7  # tokens win
    for bad in (0, 1.5):
        with pytest.raises(ValidationError, match="gpu_memory_utilization"):
            EngineConfig.from_options(gpu_memory_utilization=bad)


def test_a_step_keeps_room_for_its_activations(model_path: Path) -> None:
    from serve_app.model.runner import ModelRunner

    runner = ModelRunner(ModelConfig(name=str(model_path)))
    small, large = runner.activation_bytes(16, 16), runner.activation_bytes(512, 128)
    assert 256 * 2**20 < small < large
    # 128 sampled rows of float32 logits (and a copy) at least
    assert large - runner.activation_bytes(512, 0) >= 2 * 128 * runner.vocab_size * 4


def test_the_device_oracle_matches_transformers_in_float32(model_path: Path) -> None:
    from serve_app.bench.gpu_check import device_oracle

    result = device_oracle(str(model_path), "cpu", "float32", ["Name three rivers.", "Count to five."], 6)
    assert (result.prompts, result.equal_prompts, result.agreeing_prefix) == (2, 2, 1.0)
