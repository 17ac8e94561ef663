"""OpenAI's embeddings (`POST /v1/embeddings`): texts or token ids in, one vector each out, as floats or base64.

Each input is one engine request that ends with its prefill, batched with the generations beside it: its last
token's final hidden state, L2-normalized (vLLM's pooling of a decoder model). `dimensions` is the model's
hidden size or a 400: the packaged models are not trained to be cut short (Matryoshka)."""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field

from serve_app.http.protocols.base import DEFAULT_LIMITS, ResponseBuilder, ResponseFormatter
from serve_app.http.protocols.errors import invalid
from serve_app.http.protocols.fields import RequestModel, validate_body
from serve_app.http.protocols.limits import RequestLimits
from serve_app.http.protocols.openai.builders import ERRORS
from serve_app.http.protocols.openai.schema import prompt_list
from serve_app.http.protocols.prepared import Choice, PreparedRequest, total_usage
from serve_app.http.served_models import adapter_of
from serve_app.wire.model_card import ModelInfo
from serve_app.wire.outputs import StreamDelta
from serve_app.wire.requests import GenerateRequest


class EmbeddingRequest(RequestModel):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="the model's hidden size only (its vectors are not Matryoshka)")
    user: str | None = Field(None, max_length=256, description="the end user, recorded on the request's trace span")


class EmbeddingsBuilder(ResponseBuilder):
    """`POST /v1/embeddings`."""

    errors = ERRORS
    messages_param = "input"
    prompt_param = "input"

    def prepare(self, body: Any, model: ModelInfo, limits: RequestLimits = DEFAULT_LIMITS) -> EmbeddingsFormatter:
        req: EmbeddingRequest = validate_body(EmbeddingRequest, body, limits.unknown_fields)
        lora = adapter_of(model, req.model)
        if req.dimensions is not None and req.dimensions != model.hidden_size:
            raise invalid(
                f"dimensions: this model's embeddings have {model.hidden_size} and cannot be shortened", "dimensions"
            )
        prompts = prompt_list(req.input, "input")
        limits.check_choices(1, len(prompts), "input")  # before a request is made for each
        requests = [GenerateRequest(prompt=prompt, embed=True, max_tokens=1, lora=lora) for prompt in prompts]
        prepared = PreparedRequest(requests=requests, stream=False, model=req.model, end_user=req.user)
        return EmbeddingsFormatter(prepared, req.encoding_format)


class EmbeddingsFormatter(ResponseFormatter):
    """The list of embeddings, in input order."""

    def __init__(self, prepared: PreparedRequest, encoding: Literal["float", "base64"]) -> None:
        super().__init__(prepared)
        self.encoding = encoding

    def response(self, choices: Sequence[Choice]) -> dict[str, Any]:
        usage = total_usage(self.prepared, choices)
        data = [{"object": "embedding", "index": c.index, "embedding": self._encoded(c.embedding or ())} for c in choices]
        return {
            "object": "list", "data": data, "model": self.prepared.model,
            "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
        }

    def _encoded(self, vector: Sequence[float]) -> list[float] | str:
        """Floats, or base64 of their little-endian float32 bytes (as OpenAI's API and SDK write them)."""
        if self.encoding == "float":
            return list(vector)
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

    # An embedding is never streamed.
    def stream_start(self, choices: Sequence[Choice]) -> list[str]:
        raise AssertionError("embeddings are not streamed")

    def chunk(self, choice: Choice, delta: StreamDelta) -> list[str]:
        raise AssertionError("embeddings are not streamed")

    def stream_end(self, choices: Sequence[Choice]) -> list[str]:
        raise AssertionError("embeddings are not streamed")
