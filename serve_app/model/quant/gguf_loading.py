"""Building a model for `quantization: gguf` from the GGUF file it was made from: made with empty (meta)
parameters; every linear layer the file holds as Q4_1 or Q8_0 blocks becomes a `GgufLinear` over those blocks,
the token embedding an `Int8Embedding` over its Q8_0 blocks (an LM head tied to it shares the same codes), and
every other tensor (norms, any other linear) is read from the converted safetensors checkpoint in float32. No
float copy of a block weight is ever made."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from serve_app.model.kernels.gguf_matmul import BlockWeight, GgufMatmul, block_weight_supported
from serve_app.model.quant.gguf_blocks import GgufBlocks
from serve_app.model.quant.gguf_linear import GgufLinear, choose_kernel_rows, use_kernel
from serve_app.model.quant.int4_loading import SafetensorsCheckpoint
from serve_app.model.quant.int8_embedding import Int8Embedding
from serve_app.model.surgery import replace_modules

logger = logging.getLogger(__name__)


def load_gguf_model(
    folder: Path, hf_config, attn_implementation: str, gguf: Path, kernel: GgufMatmul
) -> torch.nn.Module | None:
    """The model at `folder` (its config `hf_config`, converted from `gguf`) with its block weights served as
    stored, on the CPU in float32; None where the folder's checkpoint is not safetensors holding every other
    tensor the model needs."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    checkpoint = SafetensorsCheckpoint.open(folder)
    if checkpoint is None:
        return None
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation=attn_implementation)
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})  # {tied name: the name it shares}
    blocks = GgufBlocks(gguf)
    embedding_module, head_module = model.get_input_embeddings(), model.get_output_embeddings()
    paths = {module: path for path, module in model.named_modules()}
    embedding = blocks.get("embedding")
    if embedding is not None and embedding.kind != "q8_0":
        embedding = None  # a 4-bit table is looked up as floats from the checkpoint
    head_tied = f"{paths[head_module]}.weight" in tied if head_module is not None else False
    head = embedding if head_tied else blocks.get("head")

    def block_weight(path: str, module: torch.nn.Module) -> BlockWeight | None:
        weight = head if module is head_module else blocks.get(path)
        if weight is None or not block_weight_supported(weight.out_features, weight.in_features):
            return None
        return weight if (weight.out_features, weight.in_features) == (module.out_features, module.in_features) else None

    served = {path: weight for path, module in model.named_modules()
              if type(module) is torch.nn.Linear and (weight := block_weight(path, module)) is not None}
    if embedding is not None:
        served[paths[embedding_module]] = embedding
    names = [name for name, tensor in model.named_parameters(remove_duplicate=False) if tensor.is_meta]
    floats_needed = [name for name in names if name.rpartition(".")[0] not in served]

    def stored_name(name: str) -> str | None:
        if name in checkpoint:
            return name
        return tied[name] if tied.get(name) in checkpoint else None

    missing = [name for name in floats_needed if stored_name(name) is None]
    if missing:
        logger.info("gguf: %s lacks %s in its safetensors; loading the float model", folder, missing[:3])
        return None
    model.load_state_dict({name: checkpoint.read(stored_name(name)).float() for name in floats_needed}, strict=False, assign=True)

    def replace(path: str, child: torch.nn.Module) -> torch.nn.Module | None:
        if path not in served:
            return None
        if isinstance(child, torch.nn.Embedding):
            return Int8Embedding(served[path].codes, served[path].scales, torch.float32)
        return GgufLinear(served[path], child.bias)

    replace_modules(model, replace)
    still_empty = [name for name, tensor in model.named_parameters(remove_duplicate=False) if tensor.is_meta]
    if still_empty:
        raise RuntimeError(f"gguf: no tensors loaded for {still_empty[:3]}")
    layer_weights = [w for p, w in served.items() if ".layers.0." in f".{p}" and w is not embedding]
    n_layers = int(getattr(hf_config.get_text_config(), "num_hidden_layers", 1))
    use_kernel(kernel, choose_kernel_rows(kernel, layer_weights, n_layers, served.get(paths.get(head_module))))
    logger.info(
        "gguf: %d linear layers served from %s's own blocks (%.0f MB)%s", sum(1 for m in model.modules() if isinstance(m, GgufLinear)),
        gguf.name, sum(w.nbytes for w in {id(w): w for w in served.values()}.values()) / 1e6,
        ", the token embedding from its Q8_0 blocks" if embedding is not None else "",
    )
    return model.eval()
