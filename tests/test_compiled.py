"""The compiled forward (`compile: true`) on a tiny Llama serving LoRA adapters, in fp32 and with int8 weights:
compiled at start for every shape class of a step, the same logits as the eager forward, the adapters'
tokens as transformers + peft gives them, and no recompile while it serves batches of every kind
(decodes, prefill chunks, prefix hits, sampling, adapters mixed with the base model)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from serve_app import GenerateRequest, InferenceEngine
from serve_app.kv.view import BatchEntry, KVCacheView
from serve_app.model.attention import step_context
from serve_app.model.compiled import WARM_UP_SHAPES
from tests.adapters import build_adapter
from tests.references import ReferenceModel


@pytest.fixture(scope="module")
def adapters(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("compiled-adapters")
    return {name: build_adapter(tiny_llama_path, folder / name, seed) for seed, name in enumerate("xy", start=5)}


@pytest.fixture(scope="module", params=["none", "int8"])
def compiled(
    tiny_llama_path: Path, adapters: dict[str, Path], request: pytest.FixtureRequest
) -> Iterator[InferenceEngine]:
    graphs = counters["stats"]["unique_graphs"]
    engine = InferenceEngine(
        model=str(tiny_llama_path), compile=True, cache_tokens=2048, max_model_len=512, max_num_batched_tokens=64,
        max_num_seqs=8, quantization=request.param, lora_paths={name: str(path) for name, path in adapters.items()},
    )
    assert counters["stats"]["unique_graphs"] - graphs == len(WARM_UP_SHAPES)  # all compiled before serving
    yield engine
    engine.shutdown()


@torch.inference_mode()
def _logits(forward, engine: InferenceEngine, entries: list[BatchEntry], keep: list[int], seed: int) -> torch.Tensor:
    tokens = sum(entry.num_new for entry in entries)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, engine.runner.vocab_size, (1, tokens), generator=generator)
    positions = torch.tensor([[p for e in entries for p in range(e.start, e.end)]])
    storage = engine.cache.storage
    pages = -(-max(e.end for e in entries) // storage.page_size)
    tables = [[len(entries) * pages + i * pages + j for j in range(pages)] for i in range(len(entries))]
    with step_context(KVCacheView(storage, entries, tables), engine.runner.decode_kernel):
        out = forward(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=torch.tensor(keep))
    return out.logits


def test_the_compiled_forward_gives_the_eager_logits(compiled: InferenceEngine) -> None:
    runner = compiled.runner
    steps = [
        ([BatchEntry(0, 0, 1)], [0]),  # one decode row
        ([BatchEntry(0, 0, 9)], [8]),  # a prefill chunk, its last row sampled
        ([BatchEntry(0, 4, 1), BatchEntry(1, 7, 1), BatchEntry(2, 0, 12)], [0, 1, 13]),  # decodes and a prefill
        ([BatchEntry(0, 6, 5, verifies=True)], [0, 1, 2, 3, 4]),  # a decode and its proposals (speculative decoding)
        ([BatchEntry(0, 9, 3, verifies=True), BatchEntry(1, 5, 1), BatchEntry(2, 0, 7)], [0, 1, 2, 3, 10]),
    ]
    graphs = counters["stats"]["unique_graphs"]
    for seed, (entries, keep) in enumerate(steps):
        eager = _logits(runner.model, compiled, entries, keep, seed)
        ours = _logits(runner.model_forward, compiled, entries, keep, seed)
        assert ours.shape == eager.shape == (1, len(keep), runner.vocab_size)
        torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs  # the start-up's graphs cover every step


def test_serving_batches_of_every_kind_recompiles_nothing(compiled: InferenceEngine) -> None:
    graphs = counters["stats"]["unique_graphs"]
    shared = list(range(100, 140))
    requests = [
        GenerateRequest(prompt=shared + [7], max_tokens=6, temperature=0, ignore_eos=True),
        GenerateRequest(prompt=shared + [8, 9], max_tokens=6, temperature=0, ignore_eos=True),  # a prefix hit
        GenerateRequest(prompt=list(range(200, 350)), max_tokens=3, temperature=0, ignore_eos=True),  # chunked
        GenerateRequest(prompt=[5, 6], max_tokens=8, temperature=1.0, seed=3, ignore_eos=True),  # sampled
        GenerateRequest(prompt=shared + [9], lora="x", max_tokens=6, temperature=0, ignore_eos=True),  # adapters
        GenerateRequest(prompt=list(range(400, 470)), lora="y", max_tokens=4, temperature=0, ignore_eos=True),
    ]
    results = [compiled.submit(r) for r in requests]
    for request, result in zip(requests, results):
        assert len(result.wait(300).token_ids) == request.max_tokens and result.finish_reason == "length"
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_compiled_forward_runs_each_rows_adapter_as_peft_does(
    compiled: InferenceEngine, tiny_llama_path: Path, adapters: dict[str, Path]
) -> None:
    """Base and adapter rows in one batch through the compiled graph: in fp32 the greedy tokens of
    transformers + peft for each; with int8 weights, each adapter still changes the answer."""
    prompts = [list(range(10 + 7 * i, 30 + 7 * i)) for i in range(6)]
    chosen = [None, "x", "y"] * 2
    results = [compiled.submit(GenerateRequest(prompt=p, lora=n, max_tokens=8, temperature=0, ignore_eos=True))
               for p, n in zip(prompts, chosen)]
    outputs = [r.wait(300).token_ids for r in results]
    if compiled.config.model.quantization == "none":
        for name in (None, "x", "y"):
            reference = ReferenceModel(tiny_llama_path, adapters[name] if name else None)
            for prompt, output, used in zip(prompts, outputs, chosen):
                if used == name:
                    assert output == reference.greedy(prompt, 8), name
    base = [compiled.submit(GenerateRequest(prompt=p, max_tokens=8, temperature=0, ignore_eos=True)) for p in prompts]
    assert all(b.wait(300).token_ids != o for b, o, n in zip(base, outputs, chosen) if n is not None)
