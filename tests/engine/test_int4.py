"""4-bit weights (`quantization: int4`): groups of 32 with a scale and a minimum on torch's CPU kernel, the
packaged GGUF's Q4_1 weights taken as stored (not dequantized and quantized again), a quarter of the weights'
bytes and less, next tokens close to fp32's, and speculation that keeps the greedy tokens."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from serve_app import GenerateRequest, InferenceEngine
from serve_app.bench.engine_bench import run_engine_bench
from serve_app.bench.prompts import grounded_chats, make_prompts
from serve_app.bench.quant_bench import teacher_forced_agreement
from serve_app.bench.random_model import make_model
from serve_app.config import DEFAULT_MODEL
from serve_app.model.loader import gguf_origin
from serve_app.model.quant.gguf_blocks import Q4_1Weights
from serve_app.model.quant.int4 import GROUP_SIZE, Int4Linear, Int4Weight, quantize_int4
from serve_app.model.quant.int4_loading import SafetensorsCheckpoint, load_int4_model
from serve_app.model.quant.int8_embedding import Int8Embedding
from serve_app.model.quant.quantization import apply_quantization


def test_a_weight_quantized_in_groups_is_within_half_a_step_and_the_layer_multiplies_by_it() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 48)
    weight = Int4Weight.quantize(linear.weight)
    assert weight.codes.dtype == torch.uint8 and int(weight.codes.max()) <= 15
    assert weight.scales.shape == weight.minimums.shape == (48, 96 // GROUP_SIZE)
    step = weight.scales.repeat_interleave(GROUP_SIZE, dim=1)
    assert bool(((weight.dequantize() - linear.weight).abs() <= step / 2 + 1e-6).all())
    x = torch.randn(5, 3, 96)
    with torch.inference_mode():
        got = Int4Linear(weight, linear.bias)(x)
        expected = torch.nn.functional.linear(x, weight.dequantize(), linear.bias)
    assert got.shape == (5, 3, 48) and got.dtype == torch.float32
    # bfloat16 activations, scales and zeros: within a few of bfloat16's steps of the float product.
    error = (got - expected).abs().amax(dim=-1) / expected.abs().amax(dim=-1)
    assert float(error.max()) < 0.02, error


def test_layers_the_kernel_cannot_take_keep_their_float_weights() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 40), torch.nn.Linear(40, 32), torch.nn.Linear(64, 32))
    assert quantize_int4(model) == 1  # 40 outputs (not a multiple of 16), 40 inputs (not of 32)
    assert [type(m).__name__ for m in model] == ["Linear", "Linear", "Int4Linear"]


def test_the_packaged_gguf_gives_every_layers_q4_1_blocks_as_the_float_model_holds_them(model_path: Path) -> None:
    """The prepared float32 folder is the GGUF dequantized (by transformers): its blocks, read as they are and
    put back in transformers' row order, give that folder's weights exactly."""
    blocks = Q4_1Weights(gguf_origin(DEFAULT_MODEL))
    floats = load_file(str(model_path / "model.safetensors"))
    paths = [name.removesuffix(".weight") for name in floats if name.startswith("model.layers.") and "_proj" in name]
    assert len(blocks) == len(paths) == 7 * 30
    for path in paths:
        torch.testing.assert_close(blocks.get(path).dequantize(), floats[f"{path}.weight"], rtol=0, atol=0)
    assert blocks.get("lm_head") is None  # tied to the Q8_0 embedding: quantized at load


@pytest.fixture(scope="module")
def int4_engine() -> Iterator[InferenceEngine]:
    eng = InferenceEngine(compile=False, model=DEFAULT_MODEL, quantization="int4", cache_tokens=4096, max_model_len=2048)
    yield eng
    eng.shutdown()


def _tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)])


def test_the_engine_serves_the_gguf_blocks_in_an_eighth_of_the_float_weights_bytes(
    int4_engine: InferenceEngine, model_path: Path
) -> None:
    model = int4_engine.runner.model
    layers = {path: m for path, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) == 7 * 30 + 1 and not [m for m in model.modules() if type(m) is torch.nn.Linear]
    blocks = Q4_1Weights(gguf_origin(DEFAULT_MODEL))
    for path in ("model.layers.0.self_attn.q_proj", "model.layers.29.mlp.down_proj"):
        from_file = Int4Linear(blocks.get(path), None)  # the file's scales and codes, not the float's requantized
        assert torch.equal(layers[path].packed, from_file.packed)
        assert torch.equal(layers[path].scales_and_zeros, from_file.scales_and_zeros)
    floats = load_file(str(model_path / "model.safetensors"))
    float_bytes = sum(floats[f"{p}.weight"].numel() * 4 for p in layers if p != "lm_head") + floats[
        "model.embed_tokens.weight"].numel() * 4
    int4_bytes = sum(_tensor_bytes(m) for m in layers.values())
    assert int4_bytes < float_bytes / 6, (int4_bytes, float_bytes)  # 4 bits and a bfloat16 scale and zero per 32
    # The token embedding is the file's 8-bit table (a byte and a 32nd of a float16 a value), looked up exactly.
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, Int8Embedding)
    assert _tensor_bytes(embedding) == floats["model.embed_tokens.weight"].numel() * (1 + 2 / 32)
    ids = torch.tensor([[0, 1, 2, 9690, 49151]])
    assert torch.equal(embedding(ids), torch.nn.functional.embedding(ids, floats["model.embed_tokens.weight"]))


def test_the_int4_engine_decodes_and_its_next_tokens_agree_with_fp32(
    int4_engine: InferenceEngine, engine: InferenceEngine, model_path: Path
) -> None:
    prompts = make_prompts(4, seed=3)
    _, continuations = run_engine_bench(engine, prompts, 4, 16, return_tokens=True)
    _, quantized = run_engine_bench(int4_engine, prompts, 4, 16, return_tokens=True)
    assert [len(tokens) for tokens in quantized] == [16] * 4
    sequences = [(engine.tokenizer.encode(p), c) for p, c in zip(prompts, continuations)]
    measured = teacher_forced_agreement(str(model_path), sequences, "int4", gguf=gguf_origin(DEFAULT_MODEL))
    assert measured.positions == 64
    assert measured.same_token >= 0.75, measured  # broken weights agree on almost nothing
    assert measured.mean_logprob_gap < 0.5, measured


def test_speculation_on_int4_keeps_its_greedy_tokens(int4_engine: InferenceEngine) -> None:
    speculating = InferenceEngine(
        compile=False, model=DEFAULT_MODEL, quantization="int4", cache_tokens=4096, max_model_len=2048,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    )
    try:
        chats = [int4_engine.tokenizer.encode_chat(chat) for chat in grounded_chats(2, seed=3)]
        for ids in chats:
            request = GenerateRequest(prompt=ids, max_tokens=24, temperature=0, ignore_eos=True)
            plain = int4_engine.submit(request).wait(120).token_ids
            assert speculating.submit(request).wait(120).token_ids == plain
        assert speculating.get_stats()["spec_decode_accepted_tokens"] > 0
    finally:
        speculating.shutdown()


def test_int4_off_the_cpu_is_refused_naming_it(tiny_llama_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantization: int4 runs on the CPU"):
        apply_quantization(torch.nn.Linear(64, 64), "int4", torch.device("meta"), tmp_path)


def test_the_packaged_gguf_loads_its_q4_1_blocks_without_reading_the_float_linear_weights(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoConfig

    read: list[str] = []
    original = SafetensorsCheckpoint.read
    monkeypatch.setattr(SafetensorsCheckpoint, "read", lambda self, name: read.append(name) or original(self, name))
    model = load_int4_model(model_path, AutoConfig.from_pretrained(model_path), torch.float32, "sdpa", gguf_origin(DEFAULT_MODEL))
    assert model is not None and not [name for name in read if "_proj" in name]
    # The LM head tied to the embedding is quantized from the float folder's table; the table itself stays the
    # GGUF's 8-bit blocks.
    assert read.count("model.embed_tokens.weight") == 1 and isinstance(model.get_input_embeddings(), Int8Embedding)
    blocks = Q4_1Weights(gguf_origin(DEFAULT_MODEL))
    layer = model.get_submodule("model.layers.7.mlp.gate_proj")
    assert torch.equal(layer.packed, Int4Linear(blocks.get("model.layers.7.mlp.gate_proj"), None).packed)
    assert not [name for name, tensor in model.named_parameters() if tensor.is_meta]


_MEMORY_PROBE = """
import sys
from pathlib import Path
from transformers import LlamaForCausalLM  # the modeling code, imported before the baseline
from serve_app.config import ModelConfig
from serve_app.model.runner import ModelRunner
from serve_app.model.tokenizer import Tokenizer
from serve_app.engine.freed_memory import give_back_freed_memory

def status(key):
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith(key + ":"))) * 1024

# Its tokenizer exported and loaded before the baseline, what that freed given back and the peak reset: the
# weights' load is what is measured.
Tokenizer(Path(sys.argv[1]))
give_back_freed_memory()
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
runner = ModelRunner(ModelConfig(name=sys.argv[1], quantization="int4"))
print(status("VmHWM") - base)
"""


def test_an_int4_load_never_holds_the_float_linear_weights(tmp_path: Path, model_path: Path) -> None:
    """Memory measured: a fresh process's peak while it loads a model of 396 MiB of float32 linear weights as int4
    stays below those bytes (loading the float model and quantizing it after peaked at 691 MiB, this way at 294)."""
    shape = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_key_value_heads": 4, "tie_word_embeddings": True}
    folder = make_model(tmp_path / "mid-random", 5, model_path, shape)
    try:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as checkpoint:  # the shapes, not the data
            linear_bytes = sum(
                math.prod(checkpoint.get_slice(name).get_shape()) * 4 for name in checkpoint.keys() if "_proj" in name
            )
        # glibc's dynamic mmap threshold keeps some freed temporaries' pages in the heap, at random (this load's
        # peak measured 280-470 MiB with it, 280-283 without): a fixed threshold measures what the load holds.
        environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        probe = subprocess.run(
            [sys.executable, "-c", _MEMORY_PROBE, str(folder)], capture_output=True, text=True, timeout=300, env=environment
        )
        assert probe.returncode == 0, probe.stderr[-2000:]
        peak = int(probe.stdout.split()[-1])
        assert peak < linear_bytes, (peak / 2**20, linear_bytes / 2**20)
    finally:
        shutil.rmtree(folder)


def test_a_float_checkpoint_is_quantized_layer_by_layer_as_the_loaded_float_model_would_be(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_llama_path)
    built = load_int4_model(tiny_llama_path, config, torch.float32, "sdpa", None)
    loaded = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    assert quantize_int4(loaded) > 0
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.inference_mode():
        torch.testing.assert_close(built(ids).logits, loaded(ids).logits, rtol=0, atol=0)
    # A checkpoint that is not safetensors is left to the float load.
    shutil.copytree(tiny_llama_path, tmp_path / "bin")
    (tmp_path / "bin" / "model.safetensors").unlink()
    assert load_int4_model(tmp_path / "bin", config, torch.float32, "sdpa", None) is None
