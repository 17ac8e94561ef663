"""LoRA adapters in the engine: base and adapter rows in one batch decode as transformers + peft does per
adapter, the adapter is part of the prefix-cache key, adapters load on first use and the least recently
used unheld one makes room, and a bad adapter is refused naming it while the engine keeps serving."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from serve_app import GenerateRequest, InferenceEngine
from serve_app.bench.idle import wait_idle
from serve_app.wire.refusals import EngineOverloadedError, InvalidRequestError
from tests.adapters import build_adapter
from tests.references import ReferenceModel

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "The three primary colours are",
    "A haiku about the sea:",
    "Water boils at",
    "The best way to learn a language is",
    "In 1969, the first people to walk on the moon",
]
LONG = "Here is a long shared passage about the history of tea, its trade routes and its many varieties. " * 2


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    folder = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(("a", "b", "c"), start=1):
        build_adapter(model_path, folder / name, seed)
    return folder


@pytest.fixture(scope="module")
def lora_engine(model_path: Path, adapters: Path) -> Iterator[InferenceEngine]:
    eng = InferenceEngine(
        compile=False,
        model=str(model_path), dynamic_lora_loading_path=str(adapters), max_num_adapters_per_replica=4,
        page_size=16, cache_tokens=8192, max_model_len=1024,
    )
    yield eng
    eng.shutdown()


def test_base_and_three_adapters_in_one_batch_decode_as_peft_does(
    lora_engine: InferenceEngine, model_path: Path, adapters: Path
) -> None:
    chosen = [None, "a", "b", "c"] * 2
    prompts = [lora_engine.tokenizer.encode(p) for p in PROMPTS]
    results = [
        lora_engine.submit(GenerateRequest(prompt=ids, lora=name, max_tokens=16, temperature=0, ignore_eos=True))
        for ids, name in zip(prompts, chosen)
    ]
    outputs = [r.wait(120).token_ids for r in results]
    for name in (None, "a", "b", "c"):
        reference = ReferenceModel(model_path, adapters / name if name else None)
        for ids, output, used in zip(prompts, outputs, chosen):
            if used == name:
                assert output == reference.greedy(ids, 16), (name, lora_engine.tokenizer.decode(ids))
    base = lora_engine.submit(GenerateRequest(prompt=prompts[1], max_tokens=16, temperature=0, ignore_eos=True))
    assert outputs[1] != base.wait(60).token_ids  # the adapter changes the answer
    wait_idle(lora_engine.get_stats)


def test_kv_made_under_one_adapter_is_never_anothers(lora_engine: InferenceEngine) -> None:
    def cached(name: str | None) -> int:
        return lora_engine.submit(GenerateRequest(prompt=LONG, lora=name, max_tokens=2, temperature=0)).wait(60).cached_tokens

    first = cached("a")
    assert cached("b") == 0 and cached(None) == 0  # the same prompt under another adapter, and the base
    assert cached("a") > first and cached("a") >= 16  # a repeat under the same adapter hits the cache


def test_least_recently_used_adapters_make_room_and_held_ones_never_do(model_path: Path, adapters: Path) -> None:
    eng = InferenceEngine(compile=False, model=str(model_path), dynamic_lora_loading_path=str(adapters), max_num_adapters_per_replica=2,
                          cache_tokens=2048, max_model_len=512)
    slots = eng.runner.adapters
    assert slots is not None
    try:
        for name in ("a", "b", "c"):
            eng.submit(GenerateRequest(prompt="Hi", lora=name, max_tokens=1)).wait(60)
        assert slots.loaded() == ["b", "c"] and slots.loads == 3
        eng.submit(GenerateRequest(prompt="Hi", lora="a", max_tokens=1)).wait(60)  # unloaded, so loaded again
        assert slots.loaded() == ["c", "a"] and slots.loads == 4
        held = [eng.submit(GenerateRequest(prompt="Count:", lora=n, max_tokens=200, ignore_eos=True)) for n in ("a", "c")]
        with pytest.raises(EngineOverloadedError):
            eng.submit(GenerateRequest(prompt="Hi", lora="b", max_tokens=1))  # both slots are held
        for stream in held:
            stream.close()
        wait_idle(eng.get_stats)
        assert eng.submit(GenerateRequest(prompt="Hi", lora="b", max_tokens=1)).wait(60).finish_reason == "length"
    finally:
        eng.shutdown()


def test_a_bad_adapter_is_refused_naming_it_and_a_running_one_finishes(
    lora_engine: InferenceEngine, adapters: Path, tiny_llama_path: Path, tmp_path: Path
) -> None:
    build_adapter(tiny_llama_path, adapters / "other-base", seed=7)
    lacking = adapters / "lacking"
    shutil.copytree(adapters / "a", lacking)
    weights = load_file(str(lacking / "adapter_model.safetensors"))
    save_file({k.replace("o_proj", "x_proj"): v for k, v in weights.items()}, str(lacking / "adapter_model.safetensors"))
    dora = adapters / "dora"
    shutil.copytree(adapters / "a", dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    running = lora_engine.submit(GenerateRequest(prompt="Count:", lora="b", max_tokens=24, ignore_eos=True))
    for name, reason in [
        ("missing", "no PEFT adapter"), ("other-base", "do not fit this model's layer"),
        ("lacking", "no LoRA-capable layer"), ("dora", "use_dora"), ("../a", "not a valid adapter name"),
    ]:
        with pytest.raises(InvalidRequestError) as refused:
            lora_engine.submit(GenerateRequest(prompt="Hi", lora=name, max_tokens=4))
        assert refused.value.param == "lora" and name in refused.value.message and reason in refused.value.message
    finished = running.wait(120)
    assert finished.finish_reason == "length" and len(finished.token_ids) == 24


def test_an_engine_without_adapters_refuses_one(engine: InferenceEngine) -> None:
    with pytest.raises(InvalidRequestError, match="serves no adapters") as refused:
        engine.submit(GenerateRequest(prompt="Hi", lora="a", max_tokens=4))
    assert refused.value.param == "lora"


def test_the_sdks_name_an_adapter_as_model_colon_adapter(lora_engine: InferenceEngine) -> None:
    from tests.inprocess import MODEL, anthropic_client, engine_server, openai_client

    ask = [{"role": "user", "content": "Name a colour."}]
    direct = {
        name: lora_engine.submit(GenerateRequest(messages=ask, lora=name, max_tokens=12, temperature=0)).wait(60).text
        for name in (None, "a")
    }
    assert direct[None] != direct["a"]
    with engine_server(lora_engine) as server:
        oai, claude = openai_client(server.url), anthropic_client(server.url)
        for name in (None, "a"):
            model = MODEL if name is None else f"{MODEL}:{name}"
            chat = oai.chat.completions.create(model=model, messages=ask, max_tokens=12, temperature=0)
            assert chat.choices[0].message.content == direct[name] and chat.model == model
            message = claude.messages.create(model=model, messages=ask, max_tokens=12, extra_body={"temperature": 0})
            assert message.content[0].text == direct[name]
        listed = {card.id: card for card in oai.models.list()}
        assert listed[MODEL].parent is None and listed[f"{MODEL}:a"].parent == MODEL
        assert {f"{MODEL}:{name}" for name in ("a", "b", "c")} <= set(listed)
        import openai

        with pytest.raises(openai.BadRequestError) as bad:
            oai.chat.completions.create(model=f"{MODEL}:missing", messages=ask, max_tokens=4)
        assert bad.value.body["param"] == "model" and "'missing'" in bad.value.body["message"]


def test_an_int8_model_runs_its_adapters_deltas_exactly(model_path: Path, adapters: Path) -> None:
    """Each LoRA layer adds `x A^T (scale B)^T` to its base layer's output, an int8 base layer too."""
    import torch

    from serve_app.model.lora import AdapterRows, lora_rows, read_adapter

    eng = InferenceEngine(compile=False, model=str(model_path), quantization="int8", dynamic_lora_loading_path=str(adapters),
                          cache_tokens=2048, max_model_len=512)
    try:
        slots = eng.runner.adapters
        assert slots is not None
        slot = slots.acquire("a")
        adapter = read_adapter("a", adapters / "a", slots.layers, slots.max_rank)
        path, (a, b) = next(iter(adapter.weights.items()))
        layer = slots.layers[path]
        assert type(layer.base).__name__ == "Int8Linear"  # the int8 layer, wrapped
        x = torch.randn(1, 5, layer.in_features)
        with torch.inference_mode():
            base = layer(x)
            with lora_rows(AdapterRows.of([(slot, [1, 3])], torch.device("cpu"))):
                mixed = layer(x)
        expected = base.clone()
        expected[0, [1, 3]] += x[0, [1, 3]] @ a.T @ b.T
        torch.testing.assert_close(mixed, expected, rtol=1e-4, atol=1e-4)
        slots.release(slot)
        ids = eng.tokenizer.encode(PROMPTS[0])
        outputs = [
            eng.submit(GenerateRequest(prompt=ids, lora=n, max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)).wait(60)
            for n in (None, "a")
        ]
        # Served, the adapter moves the first token's log-probability (on this weak model its greedy tokens
        # may well stay the same).
        first = [output.logprobs[0] for output in outputs]
        assert abs(first[0].logprob - first[1].logprob) > 1e-3, first
    finally:
        eng.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_models_adapters_named_in_lora_paths_decode_as_peft_does(
    arch: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """`InferenceEngine(model=..., lora_paths={name: folder})`: a tiny model's base and adapter rows in one batch."""
    path: Path = request.getfixturevalue(f"tiny_{arch}_path")
    folders = {name: build_adapter(path, tmp_path / f"adapter-{name}", seed) for seed, name in enumerate("xy", start=3)}
    eng = InferenceEngine(compile=False, model=str(path), lora_paths={n: str(f) for n, f in folders.items()}, cache_tokens=2048,
                          max_model_len=256)
    try:
        assert eng.runner.adapters is not None and eng.runner.adapters.available() == ["x", "y"]
        chosen = [None, "x", "y"] * 2
        prompts = [eng.tokenizer.encode(p) for p in PROMPTS[:6]]
        results = [eng.submit(GenerateRequest(prompt=ids, lora=name, max_tokens=8, temperature=0, ignore_eos=True))
                   for ids, name in zip(prompts, chosen)]
        outputs = [r.wait(120).token_ids for r in results]
        for name in (None, "x", "y"):
            reference = ReferenceModel(path, folders[name] if name else None)
            for ids, output, used in zip(prompts, outputs, chosen):
                if used == name:
                    assert output == reference.greedy(ids, 8), (arch, name)
        assert outputs[1] != eng.submit(GenerateRequest(prompt=prompts[1], max_tokens=8, temperature=0,
                                                        ignore_eos=True)).wait(60).token_ids
        with pytest.raises(InvalidRequestError, match="'z': no such adapter; known: x, y"):
            eng.submit(GenerateRequest(prompt="Hi", lora="z", max_tokens=2))
    finally:
        eng.shutdown()
