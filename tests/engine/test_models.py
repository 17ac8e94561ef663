"""Other architectures through the same path (tiny random Qwen3 and Llama), and model preparation."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serve_app import GenerateRequest, InferenceEngine
from serve_app.bench.idle import wait_idle
from serve_app.config import default_cache_dir
from serve_app.model.loader import EMBEDDED_MODELS, prepare_embedded_model
from tests.references import ReferenceModel
from tests.tiny_models import build_tiny_model

PROMPTS = [
    "A short one.",
    "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find its friends.",
    "Numbers: " + ", ".join(str(n) for n in range(60)),
    "Hello",
]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_tiny_model_greedy_equals_transformers(arch: str, kv_cache: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(f"tiny_{arch}_path")
    reference = ReferenceModel(path)
    eng = InferenceEngine(compile=False, model=str(path), kv_cache=kv_cache, page_size=8, cache_tokens=4096, max_model_len=512)
    try:
        prompts = [eng.tokenizer.encode(p) for p in PROMPTS]
        results = [
            eng.submit(GenerateRequest(prompt=ids, max_tokens=32, temperature=0, ignore_eos=True)) for ids in prompts
        ]
        for ids, result in zip(prompts, results):
            assert result.wait(60).token_ids == reference.greedy(ids, 32)
        wait_idle(eng.get_stats)
    finally:
        eng.shutdown()


def test_a_sliding_window_bounds_the_context_and_decodes_as_transformers_does(tmp_path: Path, model_path: Path) -> None:
    path = build_tiny_model(
        "qwen3", tmp_path / "sliding", model_path, use_sliding_window=True, sliding_window=48, max_window_layers=0
    )
    with pytest.raises(ValueError, match="max_model_len: 64 exceeds the model's sliding_window of 48"):
        InferenceEngine(compile=False, model=str(path), max_model_len=64, cache_tokens=1024)
    eng = InferenceEngine(compile=False, model=str(path), page_size=8, cache_tokens=1024)
    try:
        assert eng.max_model_len == 48
        ids = eng.tokenizer.encode(PROMPTS[1])[:20]
        result = eng.submit(GenerateRequest(prompt=ids, max_tokens=28, temperature=0, ignore_eos=True)).wait(60)
        assert result.token_ids == ReferenceModel(path).greedy(ids, 28)
        with pytest.raises(ValueError, match="the context holds 48"):
            eng.submit(GenerateRequest(prompt=ids, max_tokens=40))
    finally:
        eng.shutdown()


def test_attention_variants_it_does_not_compute_are_refused_at_load(tmp_path: Path, model_path: Path) -> None:
    path = build_tiny_model("gemma2", tmp_path / "softcapped", model_path, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping: the model asks for logit softcapping"):
        InferenceEngine(compile=False, model=str(path), cache_tokens=1024)


def test_qwen3_tiny_model_has_qk_norms(tiny_qwen3_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_path)
    assert hasattr(model.model.layers[0].self_attn, "q_norm")


def test_prepared_embedded_model_matches_transformers_gguf_load(model_path: Path) -> None:
    """The folder set-up converted (fresh on a new machine) gives the logits of transformers' own GGUF load."""
    from transformers import AutoModelForCausalLM

    spec = EMBEDDED_MODELS["smollm2-135m-instruct"]
    folder = prepare_embedded_model(spec, default_cache_dir())
    assert folder == model_path  # done once, at set-up
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    ids = torch.tensor([[1, 4093, 198, 19556, 905, 30]])
    prepared = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    gguf = AutoModelForCausalLM.from_pretrained(
        Path(importlib.util.find_spec(spec.package).origin).parent, gguf_file=spec.gguf_file
    )
    with torch.inference_mode():
        assert torch.allclose(prepared(ids).logits, gguf(ids).logits, atol=1e-5)


def test_prepare_model_cli(tmp_path: Path, tiny_llama_path: Path) -> None:
    cli = [sys.executable, "-m", "serve_app.cli", "prepare-model"]
    ok = subprocess.run([*cli, str(tiny_llama_path)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.strip() == str(tiny_llama_path)
    bad = subprocess.run([*cli, str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "neither an embedded model" in bad.stderr
