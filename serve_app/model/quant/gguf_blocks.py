"""A GGUF file's Q4_1 and Q8_0 weights as it stores them, read without dequantizing, under the module paths of
the transformers model made from the same file (`model.layers.N.self_attn.q_proj`, ...): `GgufBlocks` gives the
blocks themselves (`BlockWeight`, for `quantization: gguf`), `Q4_1Weights` the Q4_1 ones with one code a byte
(`Int4Weight`) and the Q8_0 token embedding (`Int8Embedding`), for `quantization: int4`. llama.cpp stores a
Llama's query and key rows permuted for its rotary layout; they are put back in transformers' order, as
transformers' own GGUF loader does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from serve_app.model.kernels.gguf_matmul import BlockWeight
from serve_app.model.quant.int4 import GROUP_SIZE, Int4Weight
from serve_app.model.quant.int8_embedding import Int8Embedding

# llama.cpp's per-block tensor names -> the transformers decoder layer's module names.
_LAYER_MODULES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Architectures whose query and key rows llama.cpp's converter permutes (transformers' LlamaTensorProcessor).
_PERMUTED_ARCHITECTURES = frozenset({"llama"})
_Q4_1_BLOCK_BYTES = 20  # fp16 scale, fp16 minimum, 16 bytes of codes (two per byte)
_Q8_0_BLOCK_BYTES = 34  # fp16 scale, 32 int8 codes


class Q4_1Weights:
    """A GGUF file's Q4_1 linear weights of the decoder layers as 4-bit codes one a byte, each read when asked for
    (so that only one layer's codes are unpacked at a time), by module path; and its Q8_0 token embedding."""

    def __init__(self, gguf: Path) -> None:
        self._blocks = GgufBlocks(gguf)
        self._paths = self._blocks.layer_paths("q4_1")

    def __len__(self) -> int:
        return len(self._paths)

    def get(self, path: str) -> Int4Weight | None:
        """The weight of the module at `path`, unpacked from its blocks, or None where the file has none."""
        if path not in self._paths:
            return None
        weight = self._blocks.get(path)
        packed = weight.codes.reshape(weight.out_features, -1, GROUP_SIZE // 2)
        # In a block, byte j holds the code of weight j in its low four bits and of weight j + 16 in its high four.
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(weight.out_features, -1)
        return Int4Weight(codes, weight.scales, weight.minimums)

    def embedding(self, dtype: torch.dtype) -> Int8Embedding | None:
        """The token embedding as its Q8_0 blocks, looked up in `dtype`, or None where the file holds it otherwise."""
        weight = self._blocks.get("embedding")
        if weight is None or weight.kind != "q8_0":
            return None
        return Int8Embedding(weight.codes, weight.scales.half(), dtype)  # the file's float16 scales, exactly


class GgufBlocks:
    """A GGUF file's Q4_1 and Q8_0 weights as their blocks (`BlockWeight`): each decoder layer's linear weights by
    module path, the token embedding, and the output head where the file has one of its own."""

    def __init__(self, gguf: Path) -> None:
        from gguf import GGMLQuantizationType, GGUFReader

        kinds = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}
        reader = GGUFReader(gguf)
        architecture = _field(reader, "general.architecture")
        heads = _field(reader, f"{architecture}.attention.head_count")
        self._heads = {"attn_q": heads, "attn_k": _field(reader, f"{architecture}.attention.head_count_kv") or heads}
        self._permuted = architecture in _PERMUTED_ARCHITECTURES
        self._tensors = {}  # module path, or "embedding" / "head" -> (llama.cpp's tensor kind, kind of block, tensor)
        for tensor in reader.tensors:
            kind = kinds.get(tensor.tensor_type)
            parts = tensor.name.split(".")  # blk.N.attn_q.weight
            if kind is None:
                continue
            if tensor.name in ("token_embd.weight", "output.weight"):
                self._tensors["embedding" if parts[0] == "token_embd" else "head"] = (parts[0], kind, tensor)
            elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_MODULES and parts[3] == "weight":
                self._tensors[f"model.layers.{parts[1]}.{_LAYER_MODULES[parts[2]]}"] = (parts[2], kind, tensor)

    def layer_paths(self, kind: str) -> frozenset[str]:
        """The module paths of the decoder layers' weights the file holds in `kind` of block (`q4_1`, `q8_0`)."""
        return frozenset(path for path, (_, held, _) in self._tensors.items() if held == kind and path.startswith("model."))

    def get(self, path: str) -> BlockWeight | None:
        """The blocks of the weight at module `path` (or `embedding`, `head`), or None where the file holds it
        otherwise."""
        if path not in self._tensors:
            return None
        name, kind, tensor = self._tensors[path]
        data = np.asarray(tensor.data)
        out_features = data.shape[0]
        blocks = data.reshape(out_features, -1, _Q4_1_BLOCK_BYTES if kind == "q4_1" else _Q8_0_BLOCK_BYTES)
        scales = torch.from_numpy(np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32))
        if kind == "q4_1":
            minimums = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32))
            codes = torch.from_numpy(np.ascontiguousarray(blocks[..., 4:]).reshape(out_features, -1))
        else:
            minimums = None
            codes = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(out_features, -1))
        weight = BlockWeight(kind, codes, scales, minimums)
        if self._permuted and name in self._heads:
            weight = weight.rows(_unpermuted_order(out_features, self._heads[name]))
        return weight


def _unpermuted_order(out_features: int, heads: int) -> torch.Tensor:
    """The file's row of each row in transformers' order: within each head, llama.cpp interleaved the rotary halves."""
    half = out_features // heads // 2
    return torch.arange(out_features).reshape(heads, half, 2).transpose(1, 2).reshape(-1)


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    return int(value) if isinstance(value, (int, np.integer)) else value
