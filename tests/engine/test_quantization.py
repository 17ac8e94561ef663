"""Quantized weights (`quantization: int8`, `fp8`): every linear layer quantized, next tokens close to fp32's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve_app import InferenceEngine
from serve_app.bench.engine_bench import run_engine_bench
from serve_app.bench.prompts import make_prompts
from serve_app.bench.quant_bench import teacher_forced_agreement
from serve_app.model.quant.fusion import GateUpMLP, fuse_gate_up
from serve_app.model.quant.quantization import apply_quantization
from serve_app.model.quant.quantize import Int8Linear
from serve_app.model.quant.weight_only import quantize_weight_only


def test_an_int8_linear_is_close_to_its_float_layer() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    x = torch.randn(5, 3, 64)
    x[0, 0] *= 50  # one token's outliers must not set the others' scale
    with torch.inference_mode():
        expected, got = linear(x), Int8Linear(linear)(x)
    assert got.shape == expected.shape == (5, 3, 32)
    error = (got - expected).abs().amax(dim=-1) / expected.abs().amax(dim=-1)
    assert float(error.max()) < 0.05, error


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_gate_and_up_projections_give_the_models_logits(family: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(f"tiny_{family}_path")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 4093, 198, 19556, 905, 30, 17, 44]])
    with torch.inference_mode():
        expected = model(ids).logits
        layers = model.config.num_hidden_layers
        assert fuse_gate_up(model) == layers
        assert sum(isinstance(m, GateUpMLP) for m in model.modules()) == layers
        assert not any(hasattr(m, "gate_proj") for m in model.modules())
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_weight_only_layers_are_close_to_their_float_layers(kind: str) -> None:
    from torchao.quantization import Float8Tensor, Int8Tensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32))
    x = torch.randn(4, 64)
    with torch.inference_mode():
        model[2].weight[5] = 0  # an all-zero row (a padding token's LM head row) must not give NaN
        expected = model(x)
        quantize_weight_only(model, kind)
        got = model(x)
    assert bool(got.isfinite().all()) and bool((got[:, 5] == expected[:, 5]).all())
    assert all(type(model[i].weight) is (Int8Tensor if kind == "int8" else Float8Tensor) for i in (0, 2))
    error = (got - expected).abs().amax(dim=-1) / expected.abs().amax(dim=-1)
    assert float(error.max()) < (0.05 if kind == "int8" else 0.15), error


def test_int8_on_the_cpu_is_fbgemm_and_fp8_is_weight_only(tiny_llama_path: Path, tmp_path: Path) -> None:
    from torchao.quantization import Float8Tensor
    from transformers import AutoModelForCausalLM

    def load() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()

    int8 = apply_quantization(load(), "int8", torch.device("cpu"), tmp_path)
    assert any(isinstance(m, GateUpMLP) for m in int8.modules())
    assert not [m for m in int8.modules() if type(m) is torch.nn.Linear]
    fp8 = apply_quantization(load(), "fp8", torch.device("cpu"), tmp_path)
    linears = [m for m in fp8.modules() if type(m) is torch.nn.Linear]
    assert linears and all(type(m.weight) is Float8Tensor for m in linears)


# fp8 dequantizes every weight at every step on the CPU: fewer, shorter requests.
@pytest.mark.parametrize(("kind", "n_prompts", "max_tokens", "seed"), [("int8", 4, 16, 3), ("fp8", 2, 12, 5)])
def test_the_quantized_engine_decodes_and_its_next_tokens_agree_with_fp32(
    kind: str, n_prompts: int, max_tokens: int, seed: int, engine: InferenceEngine, model_path: Path
) -> None:
    prompts = make_prompts(n_prompts, seed=seed)
    _, continuations = run_engine_bench(engine, prompts, n_prompts, max_tokens, return_tokens=True)
    quantized_engine = InferenceEngine(compile=False, model=str(model_path), quantization=kind, cache_tokens=4096, max_model_len=2048)
    try:
        linears = [m for m in quantized_engine.runner.model.modules() if type(m) is torch.nn.Linear]
        assert not [m for m in linears if type(m.weight) is torch.nn.Parameter]  # every one quantized
        _, quantized = run_engine_bench(quantized_engine, prompts, n_prompts, max_tokens, return_tokens=True)
    finally:
        quantized_engine.shutdown()
    assert [len(tokens) for tokens in quantized] == [max_tokens] * n_prompts
    sequences = [(engine.tokenizer.encode(p), c) for p, c in zip(prompts, continuations)]
    # int8 reads one token a step on a kernel of its own: measured both ways.
    for one_row in (False, True) if kind == "int8" else (False,):
        measured = teacher_forced_agreement(str(model_path), sequences, kind, one_row=one_row)
        assert (measured.quantization, measured.positions, measured.one_row) == (kind, n_prompts * max_tokens, one_row)
        assert measured.same_token >= 0.75, measured  # broken weights agree on almost nothing
        assert measured.mean_logprob_gap < 0.5, measured
