"""Shared fixtures: the prepared default model, transformers' reference model, tiny random models."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
import torch

from serve_app.bench.idle import wait_idle
from serve_app.bench.servers import ServeRun
from serve_app.config import DEFAULT_MODEL, default_cache_dir
from serve_app.engine.engine import InferenceEngine
from serve_app.engine.harmony import MARKERS as HARMONY_MARKERS
from serve_app.model.loader import resolve_model_path
from tests.browser import open_browser
from tests.inprocess import (
    InProcessServer,
    anthropic_client,
    engine_server,
    openai_client,
)
from tests.model_families import qwen3_tokenizer, template
from tests.references import ReferenceModel
from tests.served import FOLLOWER_IDLE_S, router_config
from tests.tiny_models import build_tiny_model, tokenizer_with_tokens

# Every engine and server a test starts runs on the CPU, float32, whatever the host has: the oracle
# compares with transformers on the CPU (`make gpu-check` runs it on CUDA).
os.environ["SERVE_APP_DEVICE"] = "cpu"
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def model_path() -> Path:
    return resolve_model_path(DEFAULT_MODEL, default_cache_dir())


@pytest.fixture(scope="module")
def head_only(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    """A two-node cluster's folder on the head node only holding the model (its files linked from the prepared default's)."""
    folder = tmp_path_factory.mktemp("head-only")
    shutil.copytree(model_path, folder / "smollm2", copy_function=os.link)
    return folder


@pytest.fixture(scope="session")
def reference(model_path: Path) -> ReferenceModel:
    """transformers' own model (SDPA attention, its own KV cache) for the greedy oracle."""
    return ReferenceModel(model_path)


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    return build_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3"), tokenizer_from=model_path)


@pytest.fixture(scope="session")
def tiny_qwen3_thinker_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model with Qwen3's own tokenizer and chat template (its <think> tokens, `enable_thinking`)."""
    return build_tiny_model(
        "qwen3", tmp_path_factory.mktemp("tiny-qwen3-thinker"), tokenizer_from=qwen3_tokenizer(),
        vocab_size=151936, bos_token_id=None, eos_token_id=151645, pad_token_id=151643, max_position_embeddings=4096,
    )


@pytest.fixture(scope="session")
def tiny_harmony_path(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    """A tiny random model with gpt-oss's real chat template, its harmony markers as special tokens of the embedded
    model's tokenizer, and its end ids (`<|return|>`, `<|call|>`)."""
    tokenizer = tokenizer_with_tokens(model_path, tmp_path_factory.mktemp("harmony-tokenizer"), list(HARMONY_MARKERS), True)
    first = 49152  # the markers' ids follow the embedded vocabulary, in `HARMONY_MARKERS`' order
    ends = [first + HARMONY_MARKERS.index(m) for m in ("<|call|>", "<|return|>")]
    return build_tiny_model(
        "qwen3", tmp_path_factory.mktemp("tiny-harmony"), tokenizer, chat_template=template("openai-gpt-oss-120b"),
        vocab_size=first + len(HARMONY_MARKERS), eos_token_id=[2, *ends], max_position_embeddings=4096,
    )


@pytest.fixture(scope="module")
def thinker(tiny_qwen3_thinker_path: Path) -> Iterator[InferenceEngine]:
    """An engine that reads the tiny Qwen3 model's thinking (`reasoning_parser: qwen3`)."""
    engine = InferenceEngine(str(tiny_qwen3_thinker_path), compile=False, reasoning_parser="qwen3", cache_tokens=16384)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"), tokenizer_from=model_path)


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[InferenceEngine]:
    """The default model on a paged cache with 16-token pages."""
    eng = InferenceEngine(compile=False, model=str(model_path), kv_cache="paged", page_size=16, cache_tokens=8192, max_model_len=2048)
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def _engine_returns_every_page(request: pytest.FixtureRequest) -> Iterator[None]:
    """After any test that used the shared `engine`, it is idle with every page back, as it was before."""
    if "engine" not in request.fixturenames:
        yield
        return
    eng: InferenceEngine = request.getfixturevalue("engine")
    wait_idle(eng.get_stats)
    yield
    wait_idle(eng.get_stats)


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeRun]:
    """The card's own command, `serve run serve_config.yaml`, in a user's environment (none of the Makefile's
    settings, no RAY_ADDRESS), on a free port, shared by every end-to-end test. Its request router stops
    following the replica board after FOLLOWER_IDLE_S without requests, so tests see it restart."""
    run = ServeRun(
        tmp_path_factory.mktemp("serve"), engine_kwargs={"cache_tokens": 8192, "max_model_len": 2048}, plain=True,
        engine_deployment={"request_router_config": router_config(idle_after_s=FOLLOWER_IDLE_S)},
        args={"batch_files_path": str(tmp_path_factory.mktemp("batch-files"))},
    )
    yield run
    run.stop()


@pytest.fixture(scope="module")
def server(engine: InferenceEngine) -> Iterator[InProcessServer]:
    """The HTTP app over the shared engine, in process (a module that needs other limits overrides it)."""
    with engine_server(engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server: InProcessServer) -> openai.OpenAI:
    return openai_client(server.url)


@pytest.fixture(scope="module")
def claude(server: InProcessServer) -> anthropic.Anthropic:
    return anthropic_client(server.url)


@pytest.fixture(scope="module")
def browser() -> Iterator:
    """Debian's headless Chromium through Selenium (a test using it is marked `tests.browser.needs_chromium`)."""
    yield from open_browser()
