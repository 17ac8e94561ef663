"""The Anthropic Messages API: `/v1/messages` (streaming events and message objects) and token counting."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app.engine.io import GenerateRequest, ModelInfo, SamplingParams, StreamDelta, StructuredOutput, Usage
from serve_app.http.protocols.base import ResponseBuilder, sse
from serve_app.http.protocols.errors import (
    ErrorFormat,
    ProtocolError,
    refuse_fields,
    validate_body,
)
from serve_app.http.protocols.prepared import Choice, PreparedRequest, total_usage
from serve_app.http.served_models import adapter_of
from serve_app.http.tools import format_for
from serve_app.http.tools.plan import (
    Prompt,
    ToolCall,
    ToolCallFormat,
    ToolPlan,
    ToolSpec,
    Turn,
    plan,
    read_answer,
    tool_answer_reader,
)
from serve_app.http.tools.stream import (
    ArgumentsDelta,
    CallStarted,
    TextDelta,
    ToolStream,
)

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


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"(error) {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def blocks(self) -> list[Block]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class Tool(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str = ""
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name: give it exactly when type is tool")
        return self


class CountTokensRequest(_Lenient):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def tool_plan(self) -> ToolPlan | None:
        """How this request may call its tools, and which (Anthropic's `any` is `required`, `tool` a named one)."""
        specs = [ToolSpec(t.name, t.description, t.input_schema) for t in self.tools or []]
        if self.tool_choice is None:
            return plan(specs, None)
        kind = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[self.tool_choice.type]
        return plan(specs, kind, self.tool_choice.name, parallel=not self.tool_choice.disable_parallel_tool_use)

    def prompt(self, tools: ToolCallFormat, tool_plan: ToolPlan | None) -> Prompt:
        """System and turns for the chat template, in the model's tool-call format: a message's tool
        results are tool turns (before its text), its tool uses the assistant turn's calls."""
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        turns = [Turn("system", system)] if system else []
        for message in self.messages:
            blocks = message.blocks()
            text = "\n".join(b.text for b in blocks if isinstance(b, TextBlock))
            turns.extend(
                Turn("tool", b.text(), call_id=b.tool_use_id) for b in blocks if isinstance(b, ToolResultBlock)
            )
            uses = tuple(
                ToolCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False))
                for b in blocks if isinstance(b, ToolUseBlock)
            )
            if uses or text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                turns.append(Turn(message.role, text, calls=uses))
        return tools.prompt(turns, tool_plan)


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
    max_string_tokens: int | None = Field(None, ge=1)

    def output_constraint(self, tools: ToolCallFormat, tool_plan: ToolPlan | None) -> StructuredOutput | None:
        """The grammar of the answer: the tool-call format's (`output_config.format` holding an answer
        that uses no tool), or `output_config.format`'s."""
        schema = self.output_config.format.schema_ if self.output_config and self.output_config.format else None
        if tool_plan is not None:
            return tools.constraint(tool_plan, schema)
        return StructuredOutput(json=schema, param="output_config.format.schema") if schema is not None else None


# Fields of Anthropic's API that this server does not implement: a 400 naming them.
UNSUPPORTED = {
    "thinking": "this server has no extended thinking",
    "mcp_servers": "not supported",
    "container": "not supported",
    "output_format": "send output_config.format",
}


def parse(model: type[BaseModel], body: Any, served: ModelInfo) -> Any:
    """Validate a body and its `model` (an unknown model is a 404, as Anthropic's API answers)."""
    refuse_fields(body, UNSUPPORTED)
    req = validate_body(model, body)
    adapter_of(served, req.model)  # an unknown model is a 404, as Anthropic's API answers
    return req


def _tool_blocks(constraint: StructuredOutput, choice: Choice) -> tuple[list[dict[str, Any]], str]:
    """A tool-mode answer's content blocks and stop reason: its text, then a `tool_use` block per whole call."""
    parsed = read_answer(constraint, choice.text, choice.complete, "toolu_")
    text = [{"type": "text", "text": parsed.content}] if parsed.content else []
    if not parsed.calls:
        return text or [{"type": "text", "text": ""}], _stop_reason(choice)
    uses = [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)} for c in parsed.calls]
    return [*text, *uses], "tool_use" if choice.complete else _stop_reason(choice)


def _block_start(index: int, block: dict[str, Any]) -> str:
    return sse({"type": "content_block_start", "index": index, "content_block": block}, "content_block_start")


class _BlockStream:
    """A tool-mode answer's content blocks as Anthropic streams them: a text block while text comes,
    a `tool_use` block for each whole call (its input in one `input_json_delta`), each stopped as the
    next one starts."""

    def __init__(self, constraint: StructuredOutput) -> None:
        self.constraint = constraint
        self.answer = ToolStream(tool_answer_reader(constraint), "toolu_")
        self.blocks = 0
        self.open: str | None = None  # the open block's type

    def update(self, text: str, finished: Choice | None = None) -> list[str]:
        """The events of the answer's next piece, `text`; with `finished`, the choice it ends, those of its end."""
        events: list[str] = []
        settled = self.answer.feed(text)
        if finished is not None:
            settled += self.answer.finish(finished.complete)
        for event in settled:
            match event:
                case TextDelta(piece):
                    if self.open != "text":
                        events += self._start({"type": "text", "text": ""})
                    events.append(self._delta({"type": "text_delta", "text": piece}))
                case CallStarted(_, call_id, name):
                    events += self._start({"type": "tool_use", "id": call_id, "name": name, "input": {}})
                case ArgumentsDelta(_, piece):
                    events.append(self._delta({"type": "input_json_delta", "partial_json": piece}))
        return events

    def close(self) -> list[str]:
        """Stop the open block (an answer with none gets one empty text block)."""
        events = [] if self.blocks else self._start({"type": "text", "text": ""})
        return [*events, sse({"type": "content_block_stop", "index": self.blocks - 1}, "content_block_stop")]

    def _start(self, block: dict[str, Any]) -> list[str]:
        events = [sse({"type": "content_block_stop", "index": self.blocks - 1}, "content_block_stop")] if self.open else []
        self.blocks, self.open = self.blocks + 1, block["type"]
        return [*events, _block_start(self.blocks - 1, block)]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}, "content_block_delta")


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


def anthropic_error(error: ProtocolError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES[error.kind], "message": error.message}}


ERRORS = ErrorFormat(anthropic_error, {"overloaded": OVERLOADED_STATUS})


class MessagesBuilder(ResponseBuilder):
    """`POST /v1/messages`."""

    errors = ERRORS
    stop_param = "stop_sequences"

    def prepare(self, body: Any, model: ModelInfo) -> PreparedRequest:
        req: MessagesRequest = parse(MessagesRequest, body, model)
        tools, tool_plan = format_for(model.tool_format), req.tool_plan()
        prompt = req.prompt(tools, tool_plan)
        request = GenerateRequest(
            messages=prompt.messages,
            tools=prompt.tools,
            max_tokens=req.max_tokens,
            sampling=SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k),
            stop=list(req.stop_sequences or []),
            structured_output=req.output_constraint(tools, tool_plan),
            max_string_tokens=req.max_string_tokens,
            lora=adapter_of(model, req.model),
        )
        constraint = request.structured_output
        options = {"blocks": _BlockStream(constraint) if tool_plan is not None and constraint else None}  # a tool-mode answer's
        return PreparedRequest(requests=[request], stream=req.stream, model=req.model, options=options)

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
        events = [sse({"type": "message_start", "message": start}, "message_start")]
        if prepared.options["blocks"] is None:  # a tool-mode answer opens its blocks as it reaches them
            events.append(_block_start(0, {"type": "text", "text": ""}))
        return [*events, sse({"type": "ping"}, "ping")]

    def format_chunk(self, prepared: PreparedRequest, choice: Choice, delta: StreamDelta) -> list[str]:
        blocks: _BlockStream | None = prepared.options["blocks"]
        if blocks is not None:
            if delta.finish_reason == "error":
                return []
            return blocks.update(delta.text, choice if delta.finish_reason is not None else None)
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
            return [sse(anthropic_error(ProtocolError("internal", choice.error or "generation failed")), "error")]
        blocks: _BlockStream | None = prepared.options["blocks"]
        if blocks is not None:
            events = blocks.close()
            stop_reason = "tool_use" if blocks.answer.called and choice.complete else _stop_reason(choice)
        else:
            events, stop_reason = [sse({"type": "content_block_stop", "index": 0}, "content_block_stop")], _stop_reason(choice)
        return [
            *events,
            sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": choice.stop_string},
                    "usage": {"output_tokens": len(choice.token_ids)},
                },
                "message_delta",
            ),
            sse({"type": "message_stop"}, "message_stop"),
        ]

    def format_response(self, prepared: PreparedRequest, choices: Sequence[Choice]) -> dict[str, Any]:
        choice = choices[0]
        stream: _BlockStream | None = prepared.options["blocks"]
        if stream is None:
            return self._message(prepared, [{"type": "text", "text": choice.text}], choice, final=True)
        blocks, stop_reason = _tool_blocks(stream.constraint, choice)
        return {**self._message(prepared, blocks, choice, final=True), "stop_reason": stop_reason}

