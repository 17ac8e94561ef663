"""The Anthropic Messages API: `/v1/messages` (streaming events and message objects) and token counting."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serve_app.engine.request import GenerateRequest, StreamDelta, Usage
from serve_app.engine.sampling_params import SamplingParams
from serve_app.engine.structured_output import StructuredOutput
from serve_app.http.engine_client import ModelInfo
from serve_app.http.protocols.base import (
    Choice,
    PreparedRequest,
    ResponseBuilder,
    sse,
    total_usage,
)
from serve_app.http.protocols.errors import ProtocolError, refuse_fields, validate_body

# Anthropic's API answers an overloaded service with 529 `overloaded_error`.
OVERLOADED_STATUS = 529

_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "too_large": "request_too_large",
    "rate_limit": "rate_limit_error",
    "not_ready": "overloaded_error",
    "overloaded": "overloaded_error",
    "internal": "api_error",
}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class Message(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class CountTokensRequest(_Lenient):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None

    def chat(self) -> list[dict[str, str]]:
        """System and turns as chat-template messages."""
        chat = []
        if self.system:
            text = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            chat.append({"role": "system", "content": text})
        chat.extend({"role": m.role, "content": m.text()} for m in self.messages)
        return chat


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Anthropic's `output_config`: its `format` (structured output) is enforced; `effort` is refused."""

    model_config = ConfigDict(extra="forbid")

    format: OutputFormat | None = None
    effort: None = Field(None, description="reasoning effort: this server has no reasoning mode")


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None

    def structured_output(self) -> StructuredOutput | None:
        if self.output_config is None or self.output_config.format is None:
            return None
        schema = self.output_config.format.schema_
        return StructuredOutput(json=schema, param="output_config.format.schema")


# Fields of Anthropic's API that this server does not implement: a 400 naming them.
UNSUPPORTED = {
    "tools": "tool use is not supported yet",
    "tool_choice": "tool use is not supported yet",
    "thinking": "this server has no extended thinking",
    "mcp_servers": "not supported",
    "container": "not supported",
    "output_format": "send output_config.format",
}


def parse(model: type[BaseModel], body: Any, served: ModelInfo) -> Any:
    """Validate a body and its `model` (an unknown model is a 404, as Anthropic's API answers)."""
    refuse_fields(body, UNSUPPORTED)
    req = validate_body(model, body)
    if req.model != served.id:
        raise ProtocolError("not_found", f"model: {req.model!r} is not served here; use {served.id!r}", "model")
    return req


def _stop_reason(choice: Choice) -> str:
    if choice.stop_string is not None:
        return "stop_sequence"
    return "max_tokens" if choice.finish_reason == "length" else "end_turn"


def _usage_json(usage: Usage) -> dict[str, int]:
    # Anthropic counts cache reads apart from input_tokens: input_tokens + cache_read_input_tokens = the prompt.
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


class MessagesBuilder(ResponseBuilder):
    """`POST /v1/messages`."""

    stop_param = "stop_sequences"

    def prepare(self, body: Any, model: ModelInfo) -> PreparedRequest:
        req: MessagesRequest = parse(MessagesRequest, body, model)
        request = GenerateRequest(
            messages=req.chat(),
            max_tokens=req.max_tokens,
            sampling=SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k),
            stop=list(req.stop_sequences or []),
            structured_output=req.structured_output(),
        )
        return PreparedRequest(requests=[request], stream=req.stream, model=req.model)

    def _message(self, prepared: PreparedRequest, content: list[dict[str, Any]], choice: Choice, final: bool) -> dict[str, Any]:
        usage = total_usage(prepared, [choice])
        return {
            "id": f"msg_{prepared.id}",
            "type": "message",
            "role": "assistant",
            "model": prepared.model,
            "content": content,
            "stop_reason": _stop_reason(choice) if final else None,
            "stop_sequence": choice.stop_string if final else None,
            "usage": _usage_json(usage),
        }

    def format_stream_start(self, prepared: PreparedRequest, choices: Sequence[Choice]) -> list[str]:
        start = self._message(prepared, [], choices[0], final=False)
        start["usage"]["output_tokens"] = 0
        return [
            sse({"type": "message_start", "message": start}, "message_start"),
            sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}, "content_block_start"),
            sse({"type": "ping"}, "ping"),
        ]

    def format_chunk(self, prepared: PreparedRequest, choice: Choice, delta: StreamDelta) -> list[str]:
        if not delta.text:
            return []
        return [
            sse(
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": delta.text}},
                "content_block_delta",
            )
        ]

    def format_stream_end(self, prepared: PreparedRequest, choices: Sequence[Choice]) -> list[str]:
        choice = choices[0]
        if choice.finish_reason == "error":
            return [sse(self.format_error(ProtocolError("internal", choice.error or "generation failed")), "error")]
        return [
            sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
            sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": _stop_reason(choice), "stop_sequence": choice.stop_string},
                    "usage": {"output_tokens": len(choice.token_ids)},
                },
                "message_delta",
            ),
            sse({"type": "message_stop"}, "message_stop"),
        ]

    def format_response(self, prepared: PreparedRequest, choices: Sequence[Choice]) -> dict[str, Any]:
        choice = choices[0]
        return self._message(prepared, [{"type": "text", "text": choice.text}], choice, final=True)

    def format_error(self, error: ProtocolError) -> dict[str, Any]:
        return {"type": "error", "error": {"type": _ERROR_TYPES[error.kind], "message": error.message}}

    def status_of(self, error: ProtocolError) -> int:
        return OVERLOADED_STATUS if error.kind == "overloaded" else error.status
