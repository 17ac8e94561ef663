"""A GGUF's own blocks served as stored (`quantization: gguf`, what `auto` picks for the packaged model): the
kernel's widened weights are bit for bit the converted float model's, its products agree with the float ones to
float32 rounding at every row count, and the engine's greedy tokens equal the float engine's."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from serve_app import GenerateRequest, InferenceEngine
from serve_app.config import DEFAULT_MODEL, default_cache_dir
from serve_app.model.kernels.gguf_matmul import BlockWeight, GgufMatmul, build_gguf_matmul
from serve_app.model.loader import gguf_origin
from serve_app.model.quant.gguf_blocks import GgufBlocks
from serve_app.model.quant.gguf_linear import GgufLinear, _widened_product
from tests.prompts import oracle_prompts

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def kernel() -> GgufMatmul:
    return build_gguf_matmul(default_cache_dir())


@pytest.fixture(scope="module")
def blocks() -> GgufBlocks:
    return GgufBlocks(gguf_origin(DEFAULT_MODEL))


def _float_weight(model_path: Path, name: str) -> torch.Tensor:
    with safe_open(str(model_path / "model.safetensors"), framework="pt") as handle:
        return handle.get_tensor(name)


def _widened(kernel: GgufMatmul, weight: BlockWeight) -> torch.Tensor:
    return kernel.dequantize(weight, 0, torch.empty(weight.out_features, weight.in_features))


@pytest.mark.parametrize("path, stored", [
    ("model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.q_proj.weight"),  # rows un-permuted from llama.cpp's
    ("model.layers.3.self_attn.k_proj", "model.layers.3.self_attn.k_proj.weight"),
    ("model.layers.7.mlp.down_proj", "model.layers.7.mlp.down_proj.weight"),
    ("embedding", "model.embed_tokens.weight"),  # Q8_0; the LM head is tied to it
])
def test_widened_blocks_are_bit_for_bit_the_converted_float_weights(kernel, blocks, model_path, path, stored) -> None:
    weight = blocks.get(path)
    assert weight.kind == ("q8_0" if path == "embedding" else "q4_1")
    assert torch.equal(_widened(kernel, weight), _float_weight(model_path, stored))
    # A slice of channels widens to the same rows.
    part = kernel.dequantize(weight, 8, torch.empty(12, weight.in_features))
    assert torch.equal(part, _float_weight(model_path, stored)[8:20])


@pytest.mark.parametrize("path", ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj", "embedding"])
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9])
def test_products_from_the_codes_agree_with_the_float_product(kernel, blocks, path, rows) -> None:
    weight = blocks.get(path)
    torch.manual_seed(rows)
    x = torch.randn(rows, weight.in_features)
    expected = torch.nn.functional.linear(x.double(), _widened(kernel, weight).double())
    got = kernel.matmul(x, weight)
    assert got.shape == (rows, weight.out_features) and got.dtype == torch.float32
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-4 * float(expected.abs().max()))


def test_many_rows_run_on_the_widened_weight_exactly_as_the_float_product(kernel, blocks, model_path) -> None:
    x = torch.randn(64, 576)
    for path, stored in [("model.layers.2.mlp.up_proj", "model.layers.2.mlp.up_proj.weight"),
                         ("embedding", "model.embed_tokens.weight")]:  # the LM head widens in slices of channels
        reference = torch.nn.functional.linear(x, _float_weight(model_path, stored))
        assert torch.equal(_widened_product(x, blocks.get(path), kernel), reference)


def test_a_weight_the_kernel_cannot_take_is_refused(kernel, blocks) -> None:
    weight = blocks.get("model.layers.0.mlp.gate_proj")
    with pytest.raises(ValueError, match="float32 rows of 576"):
        kernel.matmul(torch.randn(2, 575), weight)
    with pytest.raises(ValueError, match="gguf dequantize"):
        kernel.dequantize(weight, weight.out_features - 2, torch.empty(4, weight.in_features))


@pytest.fixture(scope="module")
def engines(model_path: Path) -> Iterator[tuple[InferenceEngine, InferenceEngine]]:
    packaged = InferenceEngine(model=DEFAULT_MODEL, compile=False, max_num_seqs=16)  # quantization auto
    dense = InferenceEngine(model=str(model_path), compile=False, max_num_seqs=16)
    yield packaged, dense
    packaged.shutdown()
    dense.shutdown()


def test_auto_serves_the_packaged_models_blocks_and_a_converted_folder_in_float(engines) -> None:
    packaged, dense = engines
    assert packaged.runner.quantization == "gguf" and dense.runner.quantization == "none"
    linears = [m for m in packaged.runner.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == [], "every linear layer is served from its blocks"
    assert sum(isinstance(m, GgufLinear) for m in packaged.runner.model.modules()) == 30 * 7 + 1
    weight_bytes = sum(t.numel() * t.element_size() for t in packaged.runner.model.state_dict().values())
    assert weight_bytes < 0.1 * sum(t.numel() * t.element_size() for t in dense.runner.model.state_dict().values())


def test_greedy_tokens_equal_the_float_models_alone_and_in_a_batch(engines, model_path) -> None:
    from serve_app.model.tokenizer import Tokenizer

    packaged, dense = engines
    prompts = oracle_prompts(Tokenizer(model_path))[:6]
    greedy = lambda ids: GenerateRequest(prompt=ids, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)  # noqa: E731
    expected = [dense.submit(greedy(ids)).wait(300).token_ids for ids in prompts]
    alone = [packaged.submit(greedy(ids)).wait(300).token_ids for ids in prompts[:2]]
    together = [r.wait(300).token_ids for r in [packaged.submit(greedy(ids)) for ids in prompts]]
    assert alone == expected[:2]
    assert together == expected


def test_gguf_asked_for_a_model_not_made_from_a_gguf_is_refused(model_path: Path) -> None:
    with pytest.raises(ValueError, match="quantization: gguf serves a GGUF file's own blocks"):
        InferenceEngine(model=str(model_path), compile=False, quantization="gguf")


def test_the_blocks_hold_a_fifth_of_the_float_bytes(blocks) -> None:
    weight = blocks.get("model.layers.0.mlp.gate_proj")
    assert weight.nbytes <= 0.2 * weight.out_features * weight.in_features * 4
    assert np.isclose(weight.nbytes / (weight.out_features * weight.in_features), 0.5 + 8 / 32)


def test_the_codes_kernel_runs_up_to_the_row_count_the_timing_chose(kernel, blocks) -> None:
    from serve_app.model.quant.gguf_linear import _ROW_CLASSES, choose_kernel_rows

    layer = [blocks.get("model.layers.0.mlp.gate_proj"), blocks.get("model.layers.0.self_attn.k_proj")]
    assert choose_kernel_rows(kernel, layer, 30, None) in (1, *_ROW_CLASSES)

    class SlowKernel(GgufMatmul):  # the same kernel, made to lose at every row count
        def matmul(self, rows, weight):
            time.sleep(0.002)
            return super().matmul(rows, weight)

    assert choose_kernel_rows(SlowKernel(kernel.library, ctypes.CDLL(str(kernel.library))), layer, 30, None) == 1
