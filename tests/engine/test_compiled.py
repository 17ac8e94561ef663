"""The compiled forward (`compile: true`, the default) on a tiny Llama serving LoRA adapters, in fp32 and with
int8 weights: compiled at start for every shape class of a step (fp32's linears on oneDNN), the same logits
as the eager forward, the adapters' tokens as transformers + peft gives them, no recompile while it serves
batches of every kind (decodes, prefill chunks, prefix hits, sampling, adapters mixed with the base model),
a second start in a fresh process loading every graph from torch's compile caches, and without a C++
compiler the eager forward after one warning. (The other tests' in-process engines run eager: this module
holds the compiled forward to the eager one.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from serve_app import GenerateRequest, InferenceEngine
from serve_app.bench.servers import ROOT
from serve_app.config import EngineConfig
from serve_app.kv.view import BatchEntry, KVCacheView
from serve_app.model.attention import step_context
from serve_app.model.compiled import WARM_UP_SHAPES
from serve_app.model import compiled as compiled_module
from serve_app.model.kernels.onednn_linear import LayoutTiming, OneDnnLinear, time_layouts
from serve_app.model.quant import quantize
from tests.adapters import build_adapter
from tests.references import ReferenceModel


@pytest.fixture(scope="module")
def adapters(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("compiled-adapters")
    return {name: build_adapter(tiny_llama_path, folder / name, seed) for seed, name in enumerate("xy", start=5)}


# fp32 twice: its linears where timing says oneDNN pays, and where it says F.linear does (which one this host
# picks is its own; each is served as picked).
_TIMINGS = {"onednn": LayoutTiming(1.0, 0.5, 1.0, 0.5), "aten": LayoutTiming(1.0, 2.0, 1.0, 1.0)}


@pytest.fixture(scope="module", params=["fp32-onednn", "fp32-aten", "int8", "int4"])
def compiled(
    tiny_llama_path: Path, adapters: dict[str, Path], request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[InferenceEngine]:
    quantization, _, layout = request.param.replace("fp32", "none").partition("-")
    # A cache folder of its own: a configuration's first start records its layout there for later starts.
    cache_dir = tmp_path_factory.mktemp(f"cache-{request.param}")
    graphs = counters["stats"]["unique_graphs"]
    with pytest.MonkeyPatch.context() as patch:
        if layout:
            patch.setattr(compiled_module, "time_layouts", lambda *_: _TIMINGS[layout])
        engine = InferenceEngine(
            model=str(tiny_llama_path), compile=True, cache_tokens=2048, max_model_len=512, max_num_batched_tokens=64,
            max_num_seqs=8, quantization=quantization, lora_paths={name: str(path) for name, path in adapters.items()},
            cache_dir=str(cache_dir),
        )
    assert counters["stats"]["unique_graphs"] - graphs == len(WARM_UP_SHAPES)  # all compiled before serving
    stats = engine.get_stats()
    assert stats["compiled_forward"] == 1 and stats["compile_graphs_compiled"] == len(WARM_UP_SHAPES)
    # fp32 linears on oneDNN where timing chose it (the LoRA-wrapped ones too); int8's and int4's are their own.
    on_onednn = [m for m in engine.runner.model.modules() if isinstance(m, OneDnnLinear)]
    assert engine.runner.compiled.linear_layout == (layout or "aten")
    assert stats["compiled_linears_on_onednn"] == int(layout == "onednn")
    assert len(on_onednn) == (7 * engine.runner.kv_shape.n_layers + 1 if layout == "onednn" else 0)
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


class Int8Products:
    """Every int8 product of a forward (fbgemm's and the one-row kernel's): recorded on one run with its weight
    and its input, then handed back on the next, whose inputs must be the recorded ones. A product rounds its
    input to the int8 grid, where a float-epsilon difference in the glue around it (a fused norm) can move a
    value across a rounding step; replayed products hold the compiled glue to the eager glue exactly."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.replaying = False
        linear = torch.ops.quantized.linear_dynamic
        monkeypatch.setattr(torch.ops.quantized, "linear_dynamic", lambda rows, packed, reduce_range: self._product(
            id(packed), rows, lambda: linear(rows, packed, reduce_range)))
        for weight_id, (kernel, weights) in list(quantize._ROWS.items()):
            monkeypatch.setitem(quantize._ROWS, weight_id, (lambda row, w, kernel=kernel: self._product(
                id(w), row, lambda: kernel(row, w)), weights))

    def _product(self, weight: int, rows: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        if not self.replaying:
            out = compute()
            self.calls.append((weight, rows.clone(), out.clone()))
            return out
        recorded_weight, recorded_rows, out = self.calls.pop(0)
        assert weight == recorded_weight
        torch.testing.assert_close(rows, recorded_rows, rtol=1e-4, atol=1e-4)
        return out.clone()


def test_the_compiled_forward_gives_the_eager_logits(compiled: InferenceEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = compiled.runner
    steps = [
        ([BatchEntry(0, 0, 1)], [0]),  # one decode row
        ([BatchEntry(0, 0, 9)], [8]),  # a prefill chunk, its last row sampled
        ([BatchEntry(0, 4, 1), BatchEntry(1, 7, 1), BatchEntry(2, 0, 12)], [0, 1, 13]),  # decodes and a prefill
        ([BatchEntry(0, 6, 5, verifies=True)], [0, 1, 2, 3, 4]),  # a decode and its proposals (speculative decoding)
        ([BatchEntry(0, 9, 3, verifies=True), BatchEntry(1, 5, 1), BatchEntry(2, 0, 7)], [0, 1, 2, 3, 10]),
    ]
    products = Int8Products(monkeypatch)
    graphs = counters["stats"]["unique_graphs"]
    for seed, (entries, keep) in enumerate(steps):
        products.replaying = False
        ours = _logits(runner.model_forward, compiled, entries, keep, seed)
        assert len(products.calls) == sum(isinstance(m, quantize.Int8Linear) for m in runner.model.modules())  # none in fp32
        products.replaying = True
        with torch.compiler.set_stance("force_eager"):  # the layers' own forward, not their compiled graphs
            eager = _logits(runner.model, compiled, entries, keep, seed)
        assert not products.calls  # the eager forward took every product the compiled one made, in its order
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
    for request, result in zip(requests, [r.wait(300) for r in results]):
        assert len(result.token_ids) == request.max_tokens and result.finish_reason == "length"
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


PROMPT = [5, 17, 300, 41, 9, 9, 12]


def _start_in_a_fresh_process(config: EngineConfig, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """`tests.engine_start` on `config`: its stats and 8 greedy tokens of PROMPT, and its stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "tests.engine_start", config.model_dump_json(), json.dumps(PROMPT)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_a_second_start_loads_every_graph_from_the_compile_cache(compiled: InferenceEngine) -> None:
    result = compiled.submit(GenerateRequest(prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True))
    tokens = list(result.wait(300).token_ids)
    second, _ = _start_in_a_fresh_process(compiled.config)
    assert second["stats"]["compiled_forward"] == 1
    # The layout the first start chose, read back rather than timed again: the graphs it loads are that layout's.
    assert second["stats"]["compiled_linears_on_onednn"] == compiled.get_stats()["compiled_linears_on_onednn"]
    assert second["stats"]["compile_graphs_compiled"] == 0
    assert second["stats"]["compile_graphs_loaded"] == len(WARM_UP_SHAPES)
    assert second["tokens"] == tokens


def test_without_a_cpp_compiler_the_engine_runs_eager_after_one_warning(tiny_llama_path: Path) -> None:
    config = EngineConfig.from_options(model=str(tiny_llama_path), cache_tokens=1024, max_model_len=256)
    assert config.model.compile  # the default
    started, stderr = _start_in_a_fresh_process(config, env={"CXX": "/nonexistent/g++"})
    warnings = [line for line in stderr.splitlines() if "running the eager forward" in line]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0] and "Traceback" not in stderr, stderr
    assert started["stats"]["compiled_forward"] == 0
    assert started["tokens"] == ReferenceModel(tiny_llama_path).greedy(PROMPT, 8)


def test_onednn_linears_give_the_plain_products_and_restore_exactly(tiny_llama_path: Path) -> None:
    """The fp32 compiled forward's linears on oneDNN: the products `nn.Linear` gives (to float rounding), and
    after a failed compile the very weights back."""
    from transformers import AutoModelForCausalLM

    from serve_app.model.kernels.onednn_linear import onednn_supported, pack_linears, restore_linears

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    assert onednn_supported(torch.device("cpu"))
    linears = {name: m.weight.detach().clone() for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    x = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(inputs_embeds=x).logits
        assert pack_linears(model) == len(linears)
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        packed = model(inputs_embeds=x).logits
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)
    restore_linears(model)
    restored = {name: m.weight for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    assert restored.keys() == linears.keys() and not any(isinstance(m, OneDnnLinear) for m in model.modules())
    assert all(torch.equal(restored[name], weight) for name, weight in linears.items())


def test_a_start_times_both_layouts_on_the_models_own_weights_and_packs_where_onednn_wins(tiny_llama_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    layers = compiled_module.decoder_layers(model)
    linears = [m for m in layers[0].modules() if type(m) is torch.nn.Linear]
    timing = time_layouts(linears, len(layers), model.lm_head)
    assert min(timing.aten_one_row, timing.onednn_one_row) > 0 and timing.aten_batch > timing.aten_one_row
    chosen = compiled_module.choose_linear_layout(model, layers, torch.device("cpu"))
    assert chosen in ("onednn", "aten")
    # The rule: oneDNN where its ratios to F.linear's at one row and at a batch multiply to under 1.
    assert LayoutTiming(1.0, 0.8, 1.0, 1.1).onednn_pays and not LayoutTiming(1.0, 1.4, 1.0, 0.93).onednn_pays
    assert compiled_module.choose_linear_layout(model, layers, torch.device("meta")) == "aten"
