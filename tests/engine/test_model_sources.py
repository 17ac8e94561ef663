"""Where a model comes from, prepared on the node that runs it: a GGUF file converted once into this
node's cache folder, a Hugging Face Hub id that cannot be reached failing with a message that names
it, and the app leaving each replica's node to pick its own cache folder and device."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from deployments.app import build_app
from deployments.app_args import LLMConfig
from serve_app.bench.servers import free_port
from serve_app.model.loader import EMBEDDED_MODELS, HubModel, model_source

PREPARE = [sys.executable, "-m", "serve_app.cli", "prepare-model"]


def _packaged_gguf() -> Path:
    spec = EMBEDDED_MODELS["smollm2-135m-instruct"]
    return Path(importlib.util.find_spec(spec.package).origin).parent / spec.gguf_file


def test_a_gguf_file_is_prepared_once_into_the_cache_folder(tmp_path: Path, model_path: Path) -> None:
    gguf = _packaged_gguf()
    first = subprocess.run([*PREPARE, str(gguf), "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    folder = Path(first.stdout.strip().splitlines()[-1])
    assert folder.parent == tmp_path / "models" / "gguf" and folder.name.startswith(gguf.stem)
    prepared, packaged = load_file(folder / "model.safetensors"), load_file(model_path / "model.safetensors")
    assert prepared.keys() == packaged.keys()
    assert all(torch.equal(prepared[name], packaged[name]) for name in prepared)  # the same file, the same weights
    again = subprocess.run([*PREPARE, str(gguf), "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.strip() == str(folder)  # found ready: nothing converted again


def test_an_unreachable_hub_id_fails_naming_the_id_and_the_cause(tmp_path: Path) -> None:
    assert model_source("some-org/some-model") == HubModel("some-org/some-model")
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the Hub cannot be reached
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_ENDPOINT": closed}
    run = subprocess.run(
        [*PREPARE, "some-org/some-model", "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
        env=env,
    )
    assert run.returncode != 0
    assert "could not fetch 'some-org/some-model' from the Hugging Face Hub" in run.stderr
    assert "Connection refused" in run.stderr or "ConnectError" in run.stderr, run.stderr
    left = [path.name for path in (tmp_path / "models" / "hub").iterdir()]
    assert left == [".some-org--some-model.lock"]  # nothing half-fetched is left, nor taken as prepared


def test_each_replica_picks_its_own_nodes_cache_folder_and_device(monkeypatch, tmp_path: Path) -> None:
    """The app's config leaves `cache_dir` and `device` open unless the args set them, so each replica takes its
    node's (`SERVE_APP_CACHE_DIR` and `SERVE_APP_DEVICE` there, else ~/.cache/serve-app and auto)."""
    def engine_arg(args: dict) -> dict:  # what the model's engine deployment is built with
        (engine,) = build_app(args)._bound_deployment.init_args[0].values()
        return engine._bound_deployment.init_args[0]

    dumped = engine_arg({})
    assert "cache_dir" not in dumped.get("engine_kwargs", {}) and "device" not in dumped.get("engine_kwargs", {})
    monkeypatch.setenv("SERVE_APP_CACHE_DIR", str(tmp_path / "this-node"))
    monkeypatch.setenv("SERVE_APP_DEVICE", "cpu")
    on_this_node = LLMConfig.model_validate(dumped).engine().model  # as a replica validates it on its node
    assert on_this_node.cache_dir == tmp_path / "this-node" and on_this_node.device == "cpu"
    chosen = LLMConfig.model_validate(engine_arg({"cache_dir": "/models", "device": "cuda"})).engine().model
    assert chosen.cache_dir == Path("/models") and chosen.device == "cuda"