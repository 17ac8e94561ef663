"""The Messages builder and its formatter: message objects and the streamed events (content blocks as they are
written); Anthropic's error shape, with 529 for an overload."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from serve_app.http.protocols.anthropic.schema import MessagesRequest, parse, thinking_signature
from serve_app.http.protocols.base import DEFAULT_LIMITS, ResponseBuilder, ResponseFormatter, sse
from serve_app.http.protocols.errors import ErrorFormat, ProtocolError
from serve_app.http.protocols.limits import RequestLimits
from serve_app.http.protocols.prepared import Choice, PreparedRequest, total_usage
from serve_app.http.served_models import adapter_of
from serve_app.http.tools import format_for
from serve_app.http.tools.plan import read_answer, tool_answer_reader
from serve_app.http.tools.stream import (
    ArgumentsDelta,
    CallStarted,
    TextDelta,
    ToolStream,
    ToolStreamEvent,
)
from serve_app.wire.model_card import ModelInfo
from serve_app.wire.outputs import StreamDelta, Usage
from serve_app.wire.requests import GenerateRequest, SamplingParams, StructuredOutput


def _tool_blocks(constraint: StructuredOutput, choice: Choice) -> tuple[list[dict[str, Any]], str]:
    """A tool-mode answer's content blocks and stop reason: its text, then a `tool_use` block per whole call."""
    parsed = read_answer(constraint, choice.text, choice.complete, "toolu_")
    text = [{"type": "text", "text": parsed.content}] if parsed.content else []
    if not parsed.calls:
        return text or [{"type": "text", "text": ""}], _stop_reason(choice)
    uses = [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)} for c in parsed.calls]
    return [*text, *uses], "tool_use" if choice.complete else _stop_reason(choice)


def _thinking_block(thinking: str) -> dict[str, Any]:
    """A thinking block, signed with the digest that `thinking_signature` checks when a conversation sends it back."""
    return {"type": "thinking", "thinking": thinking, "signature": thinking_signature(thinking)}


def _block_start(index: int, block: dict[str, Any]) -> str:
    return sse({"type": "content_block_start", "index": index, "content_block": block}, "content_block_start")


class _BlockStream:
    """An answer's content blocks as Anthropic streams them, each opened as the answer reaches it and stopped as
    the next one starts: a thinking block while the model thinks (its signature as it ends), a text block while
    text comes, and in tool mode a `tool_use` block for each whole call (its input in one `input_json_delta`)."""

    def __init__(self, constraint: StructuredOutput | None) -> None:
        self.constraint = constraint  # a tool-mode answer's grammar (None: text only)
        self.answer = ToolStream(tool_answer_reader(constraint), "toolu_") if constraint is not None else None
        self.blocks = 0
        self.open: str | None = None  # the open block's type
        self.thinking = ""  # the open thinking block's text, for its signature

    @property
    def called(self) -> bool:
        return self.answer is not None and self.answer.called

    def update(self, delta: StreamDelta, finished: Choice | None = None) -> list[str]:
        """The events of the answer's next delta; with `finished`, the choice it ends, those of its end."""
        events: list[str] = []
        if delta.reasoning:
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.thinking += delta.reasoning
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if self.answer is None:
            settled: list[ToolStreamEvent] = [TextDelta(delta.text)] if delta.text else []
        else:
            settled = self.answer.feed(delta.text)
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
        events = self._start({"type": "text", "text": ""}) if self.open in (None, "thinking") else []
        return [*events, sse({"type": "content_block_stop", "index": self.blocks - 1}, "content_block_stop")]

    def _start(self, block: dict[str, Any]) -> list[str]:
        events = []
        if self.open == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": thinking_signature(self.thinking)}))
        if self.open:
            events.append(sse({"type": "content_block_stop", "index": self.blocks - 1}, "content_block_stop"))
        self.blocks, self.open = self.blocks + 1, block["type"]
        return [*events, _block_start(self.blocks - 1, block)]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}, "content_block_delta")


def _stop_reason(choice: Choice) -> str:
    if choice.stop_string is not None:
        return "stop_sequence"
    return "max_tokens" if choice.finish_reason == "length" else "end_turn"


def _usage_json(usage: Usage) -> dict[str, int]:
    # Anthropic counts cache reads and writes apart from input_tokens: the three together are the prompt.
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens - usage.cache_written_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": usage.cache_written_tokens,
    }


_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "too_large": "request_too_large",
    "unsupported_media_type": "invalid_request_error",
    "rate_limit": "rate_limit_error",
    "not_ready": "overloaded_error",
    "overloaded": "overloaded_error",
    "internal": "api_error",
}


def anthropic_error(error: ProtocolError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES[error.kind], "message": error.message}}


# Anthropic's API answers an overloaded service with 529 `overloaded_error`.
ERRORS = ErrorFormat(anthropic_error, {"overloaded": 529})


class MessagesBuilder(ResponseBuilder):
    """`POST /v1/messages`."""

    errors = ERRORS
    stop_param = "stop_sequences"

    def prepare(self, body: Any, model: ModelInfo, limits: RequestLimits = DEFAULT_LIMITS) -> MessagesFormatter:
        req: MessagesRequest = parse(MessagesRequest, body, model, limits.unknown_fields)
        tools, tool_plan = format_for(model.tool_format), req.tool_plan()
        prompt = req.prompt(tools, tool_plan)
        thinking = req.thinking_budget(model, req.output_config.effort if req.output_config is not None else None)
        request = GenerateRequest(
            messages=prompt.messages,
            tools=prompt.tools,
            max_tokens=req.max_tokens,
            sampling=SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k),
            stop=list(req.stop_sequences or []),
            structured_output=req.output_constraint(tools, tool_plan),
            max_string_tokens=req.max_string_tokens,
            lora=adapter_of(model, req.model),
            cache_prefix=req.cache_prefix(tools, tool_plan),
            thinking_token_budget=thinking.budget,
            chat_template_kwargs=thinking.template_kwargs(None),
        )
        constraint = request.structured_output
        blocks = _BlockStream(constraint if tool_plan is not None else None)
        end_user = req.metadata.user_id if req.metadata is not None else None
        prepared = PreparedRequest(requests=[request], stream=req.stream, model=req.model, end_user=end_user)
        return MessagesFormatter(prepared, blocks)


class MessagesFormatter(ResponseFormatter):
    """A message: its streamed events (`message_start` ... `message_stop`), or the whole message."""

    def __init__(self, prepared: PreparedRequest, blocks: _BlockStream) -> None:
        super().__init__(prepared)
        self.blocks = blocks  # the answer's content blocks, opened as it reaches them

    def _message(self, content: list[dict[str, Any]], choice: Choice, final: bool) -> dict[str, Any]:
        prepared = self.prepared
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

    def stream_start(self, choices: Sequence[Choice]) -> list[str]:
        start = self._message([], choices[0], final=False)
        start["usage"]["output_tokens"] = 0
        return [sse({"type": "message_start", "message": start}, "message_start"), sse({"type": "ping"}, "ping")]

    def chunk(self, choice: Choice, delta: StreamDelta) -> list[str]:
        if delta.finish_reason == "error":
            return []
        return self.blocks.update(delta, choice if delta.finish_reason is not None else None)

    def stream_end(self, choices: Sequence[Choice]) -> list[str]:
        choice = choices[0]
        if choice.finish_reason == "error":
            return [sse(anthropic_error(ProtocolError("internal", choice.error or "generation failed")), "error")]
        events = self.blocks.close()
        stop_reason = "tool_use" if self.blocks.called and choice.complete else _stop_reason(choice)
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

    def response(self, choices: Sequence[Choice]) -> dict[str, Any]:
        choice = choices[0]
        thinking = [_thinking_block(choice.reasoning)] if choice.reasoning else []
        constraint = self.blocks.constraint
        if constraint is None:
            return self._message([*thinking, {"type": "text", "text": choice.text}], choice, final=True)
        blocks, stop_reason = _tool_blocks(constraint, choice)
        return {**self._message([*thinking, *blocks], choice, final=True), "stop_reason": stop_reason}
