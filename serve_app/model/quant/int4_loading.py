"""Building a model for `quantization: int4` without its float linear weights ever in memory: the model is
made with empty (meta) parameters; its other tensors (embeddings, norms, biases) are read from the safetensors
checkpoint; then each linear layer the kernel takes becomes an `Int4Linear`, from the GGUF's Q4_1 blocks where
the model was made from a GGUF (`gguf_blocks.py`), else from its float weight read alone and quantized; a GGUF's
8-bit token embedding stays in its blocks (`Int8Embedding`). The peak is the 4-bit model and one float layer,
not the float model (loading it and quantizing after holds all of its float weights at once)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from serve_app.model.quant.gguf_blocks import Q4_1Weights
from serve_app.model.quant.int4 import Int4Weight, int4_supported, quantize_int4
from serve_app.model.surgery import replace_modules

logger = logging.getLogger(__name__)


class SafetensorsCheckpoint:
    """A model folder's safetensors tensors by name (`model.safetensors`, or the shards its index names),
    each read when asked for."""

    def __init__(self, files: dict[str, Path]) -> None:
        self._files = files  # tensor name -> the file that holds it

    @staticmethod
    def open(folder: Path) -> SafetensorsCheckpoint | None:
        """The folder's checkpoint, or None where it holds no safetensors one."""
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return SafetensorsCheckpoint({name: folder / file for name, file in weight_map.items()})
        single = folder / "model.safetensors"
        if not single.is_file():
            return None
        with safe_open(str(single), framework="pt") as handle:
            return SafetensorsCheckpoint({name: single for name in handle.keys()})

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._files[name]), framework="pt") as handle:
            return handle.get_tensor(name)


def load_int4_model(
    folder: Path, hf_config, dtype: torch.dtype, attn_implementation: str, gguf: Path | None
) -> torch.nn.Module | None:
    """The model at `folder` (its config `hf_config`) with its linear layers 4-bit and its other tensors in
    `dtype`, on the CPU; `gguf`: the file it was made from, if any. None where the folder's checkpoint is not
    safetensors holding every tensor the model needs (the caller then loads the float model and quantizes it)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    checkpoint = SafetensorsCheckpoint.open(folder)
    if checkpoint is None:
        return None
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})  # {tied name: the name it shares}

    def stored_name(name: str) -> str | None:
        if name in checkpoint:
            return name
        return tied[name] if tied.get(name) in checkpoint else None

    quantized = {
        f"{path}.weight" for path, module in model.named_modules()
        if type(module) is torch.nn.Linear and int4_supported(module.out_features, module.in_features)
    }
    names = [name for name, tensor in model.named_parameters(remove_duplicate=False) if tensor.is_meta]
    missing = [name for name in names if stored_name(name) is None]
    if missing:
        logger.info("int4: %s lacks %s in its safetensors; loading the float model to quantize it", folder, missing[:3])
        return None
    blocks = Q4_1Weights(gguf) if gguf is not None else None
    embedding = blocks.embedding(dtype) if blocks is not None else None
    embedding_path = next(path for path, module in model.named_modules() if module is model.get_input_embeddings())
    if embedding is not None:  # the GGUF's 8-bit table, not the float one (an LM head tied to it reads that)
        quantized.add(f"{embedding_path}.weight")
    floats = {name: checkpoint.read(stored_name(name)).to(dtype) for name in names if name not in quantized}
    model.load_state_dict(floats, strict=False, assign=True)
    quantize_int4(model, _weights_for(blocks, checkpoint, floats, stored_name))
    if embedding is not None:
        replace_modules(model, lambda path, _: embedding if path == embedding_path else None)
    still_empty = [name for name, tensor in model.named_parameters(remove_duplicate=False) if tensor.is_meta]
    if still_empty:
        raise RuntimeError(f"int4: no tensors loaded for {still_empty[:3]}")
    return model.eval()


def _weights_for(
    blocks: Q4_1Weights | None, checkpoint: SafetensorsCheckpoint, floats: dict[str, torch.Tensor],
    stored_name: Callable[[str], str | None],
) -> Callable[[str], Int4Weight]:
    """A linear layer's 4-bit weight by module path: the GGUF's blocks, else its float weight (the one already
    loaded where it is tied to one, e.g. an LM head to the embedding) quantized."""

    def weight(path: str) -> Int4Weight:
        given = blocks.get(path) if blocks is not None else None
        if given is not None:
            return given
        name = stored_name(f"{path}.weight")
        return Int4Weight.quantize(floats[name] if name in floats else checkpoint.read(name))

    return weight
