"""An embedding table kept as a GGUF stores it in 8 bits (Q8_0: per 32 values a float16 scale and 32 int8
codes, `value = scale * code`), its rows made float only when looked up: for `quantization: int4` from a GGUF,
whose token embedding llama.cpp writes as Q8_0. The rows it gives are exactly the dequantized file's."""

from __future__ import annotations

import torch

GROUP_SIZE = 32


class Int8Embedding(torch.nn.Module):
    """`torch.nn.Embedding`'s lookup over int8 codes [rows, dim] and their float16 scales [rows, dim / 32]."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        codes = self.codes[ids].to(torch.float32).unflatten(-1, (-1, GROUP_SIZE))
        rows = codes * self.scales[ids].to(torch.float32).unsqueeze(-1)
        return rows.flatten(-2).to(self.dtype)
