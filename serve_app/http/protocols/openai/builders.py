"""The OpenAI builders: chat completions and legacy completions, streamed and not; OpenAI's error shape."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from serve_app.engine.io import GenerateRequest, ModelInfo, StreamDelta, StructuredOutput, TokenLogprob, Usage
from serve_app.http.protocols.base import ResponseBuilder, sse
from serve_app.http.protocols.errors import ErrorFormat, ProtocolError, invalid, refuse_fields, validate_body
from serve_app.http.protocols.openai.schema import UNSUPPORTED, ChatCompletionRequest, CompletionRequest, SamplingFields
from serve_app.http.protocols.prepared import Choice, PreparedRequest, total_usage
from serve_app.http.served_models import adapter_of
from serve_app.http.tools import format_for
from serve_app.http.tools.plan import ParsedOutput, read_answer, tool_answer_reader
from serve_app.http.tools.stream import (
    ArgumentsDelta,
    CallStarted,
    TextDelta,
    ToolStream,
    ToolStreamEvent,
)


_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "too_large": "invalid_request_error",
    "rate_limit": "rate_limit_error",
    "not_ready": "service_unavailable",
    "overloaded": "service_unavailable",
    "internal": "internal_error",
}


def openai_error(error: ProtocolError) -> dict[str, Any]:
    """An error in OpenAI's shape (every OpenAI route's, the Responses API's, the admin and KV routes' too)."""
    return {"error": {"message": error.message, "type": _ERROR_TYPES[error.kind], "param": error.param, "code": error.status}}


ERRORS = ErrorFormat(openai_error)


def _usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _prepared(
    req: SamplingFields, requests: list[GenerateRequest], logprobs: bool, token_ids: bool = False
) -> PreparedRequest:
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options: only allowed when stream is true", "stream_options")
    return PreparedRequest(
        requests=requests,
        stream=req.stream,
        model=req.model,
        choices_per_prompt=req.n,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        options={"logprobs": logprobs, "token_ids": token_ids},
    )


def _tool_message(constraint: StructuredOutput, choice: Choice) -> dict[str, Any]:
    """A tool-mode choice's message: its text and its whole calls (finish reason `tool_calls`, or `length`
    where the token limit cut the answer after them)."""
    parsed: ParsedOutput = read_answer(constraint, choice.text, choice.complete, "call_")
    if not parsed.calls:
        return {"message": {"role": "assistant", "content": parsed.content or ""}}
    calls = [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call in parsed.calls
    ]
    message = {"role": "assistant", "content": parsed.content, "tool_calls": calls}
    return {"message": message, "finish_reason": "tool_calls" if choice.finish_reason == "stop" else _finish_reason(choice)}


def _finish_reason(choice: Choice) -> str | None:
    return choice.finish_reason if choice.finish_reason in (None, "stop", "length") else "stop"


class _OpenAIBuilder(ResponseBuilder):
    """What both OpenAI routes share: errors, usage chunks, the closing `[DONE]`."""

    errors = ERRORS
    object_chunk: str
    id_prefix: str

    def _chunk(self, prepared: PreparedRequest, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {
            "id": self._id(prepared),
            "object": self.object_chunk,
            "created": prepared.created,
            "model": prepared.model,
            "choices": choices,
        }
        if prepared.include_usage:
            chunk["usage"] = None
        return chunk

    def format_stream_end(self, prepared: PreparedRequest, choices: Sequence[Choice]) -> list[str]:
        events = []
        failed = next((c for c in choices if c.finish_reason == "error"), None)
        if failed is not None:
            events.append(sse(openai_error(ProtocolError("internal", failed.error or "generation failed"))))
        elif prepared.include_usage:
            chunk = self._chunk(prepared, [])
            chunk["usage"] = _usage_json(total_usage(prepared, choices))
            events.append(sse(chunk))
        events.append(sse("[DONE]"))
        return events

    def _id(self, prepared: PreparedRequest) -> str:
        return self.id_prefix + prepared.id

    @abstractmethod
    def _logprobs(self, prepared: PreparedRequest, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None: ...

    def _response(
        self,
        prepared: PreparedRequest,
        object_name: str,
        choices: Sequence[Choice],
        content: Callable[[Choice], dict[str, Any]],
    ) -> dict[str, Any]:
        """The non-streaming body: each choice's `content` fields (which may set its finish reason) and logprobs."""
        return {
            "id": self._id(prepared),
            "object": object_name,
            "created": prepared.created,
            "model": prepared.model,
            "choices": [
                {
                    "index": c.index,
                    "logprobs": self._logprobs(prepared, c.logprobs),
                    "finish_reason": _finish_reason(c),
                    **content(c),
                }
                for c in choices
            ],
            "usage": _usage_json(total_usage(prepared, choices)),
        }


class ChatCompletionsBuilder(_OpenAIBuilder):
    """`POST /v1/chat/completions`."""

    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def prepare(self, body: Any, model: ModelInfo) -> PreparedRequest:
        refuse_fields(body, UNSUPPORTED)
        req: ChatCompletionRequest = validate_body(ChatCompletionRequest, body)
        lora = adapter_of(model, req.model)
        tools, tool_plan = format_for(model.tool_format), req.tool_plan()
        prompt = req.prompt(tools, tool_plan)
        constraint = req.output_constraint(tools, tool_plan)
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        requests = [
            GenerateRequest(
                messages=prompt.messages, tools=prompt.tools,
                **req.engine_fields(max_tokens, logprobs, choice, constraint, lora),
            )
            for choice in range(req.n)
        ]
        prepared = _prepared(req, requests, logprobs=req.logprobs)
        prepared.options["tools"] = constraint if tool_plan is not None else None  # a tool-mode answer's grammar
        prepared.options["tool_streams"] = {}
        return prepared

    def _logprobs(self, prepared: PreparedRequest, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not prepared.options["logprobs"]:
            return None
        return {
            "content": [
                {
                    "token": lp.token,
                    "logprob": lp.logprob,
                    "bytes": list(lp.token.encode("utf-8")),
                    "top_logprobs": [
                        {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}
                        for _, text, value in lp.top
                    ],
                }
                for lp in logprobs
            ]
        }

    def format_stream_start(self, prepared: PreparedRequest, choices: Sequence[Choice]) -> list[str]:
        return [
            sse(
                self._chunk(
                    prepared,
                    [
                        {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                        for c in choices
                    ],
                )
            )
        ]

    def format_chunk(self, prepared: PreparedRequest, choice: Choice, delta: StreamDelta) -> list[str]:
        if prepared.options["tools"]:
            return self._tool_chunks(prepared, choice, delta)
        events = []
        if delta.text or delta.logprobs and prepared.options["logprobs"]:
            events.append(
                sse(
                    self._chunk(
                        prepared,
                        [
                            {
                                "index": choice.index,
                                "delta": {"content": delta.text},
                                "logprobs": self._logprobs(prepared, delta.logprobs),
                                "finish_reason": None,
                            }
                        ],
                    )
                )
            )
        if delta.finish_reason is not None and delta.finish_reason != "error":
            events.append(
                sse(
                    self._chunk(
                        prepared,
                        [{"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": _finish_reason(choice)}],
                    )
                )
            )
        return events

    def format_response(self, prepared: PreparedRequest, choices: Sequence[Choice]) -> dict[str, Any]:
        if prepared.options["tools"]:
            return self._response(
                prepared, "chat.completion", choices, lambda c: _tool_message(prepared.options["tools"], c)
            )
        return self._response(
            prepared, "chat.completion", choices, lambda c: {"message": {"role": "assistant", "content": c.text}}
        )

    def _tool_chunks(self, prepared: PreparedRequest, choice: Choice, delta: StreamDelta) -> list[str]:
        """A tool-mode choice streams as it is read: its text as content, each whole call's id, type and
        name, then its arguments (as OpenAI streams them)."""
        if delta.finish_reason == "error":
            return []
        streams: dict[int, ToolStream] = prepared.options["tool_streams"]
        if choice.index not in streams:
            streams[choice.index] = ToolStream(tool_answer_reader(prepared.options["tools"]), "call_")
        stream = streams[choice.index]

        def chunk(delta_body: dict[str, Any], finish_reason: str | None = None) -> str:
            body = {"index": choice.index, "delta": delta_body, "logprobs": None, "finish_reason": finish_reason}
            return sse(self._chunk(prepared, [body]))

        events = [chunk(_tool_delta(event)) for event in stream.feed(delta.text)]
        if delta.finish_reason is not None:
            events += [chunk(_tool_delta(event)) for event in stream.finish(choice.complete)]
            called = stream.called and choice.finish_reason == "stop"
            events.append(chunk({}, "tool_calls" if called else _finish_reason(choice)))
        return events


def _tool_delta(event: ToolStreamEvent) -> dict[str, Any]:
    """A chat chunk's `delta` for one event of a tool-mode answer."""
    match event:
        case TextDelta(text):
            return {"content": text}
        case CallStarted(call, call_id, name):
            started = {"index": call, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
            return {"tool_calls": [started]}
        case ArgumentsDelta(call, text):
            return {"tool_calls": [{"index": call, "function": {"arguments": text}}]}


class CompletionsBuilder(_OpenAIBuilder):
    """`POST /v1/completions` (legacy): prompts as text or token ids, several per request."""

    object_chunk = "text_completion"
    id_prefix = "cmpl-"

    def prepare(self, body: Any, model: ModelInfo) -> PreparedRequest:
        refuse_fields(body, {**UNSUPPORTED, "response_format": "legacy completions take structured_outputs"})
        req: CompletionRequest = validate_body(CompletionRequest, body)
        lora = adapter_of(model, req.model)
        if req.echo:
            raise invalid("echo: only false is supported", "echo")
        if req.suffix:
            raise invalid("suffix: not supported by this model", "suffix")
        prompts = _prompts(req.prompt)
        constraint = req.structured_output()
        requests = [
            GenerateRequest(prompt=prompt, **req.engine_fields(req.max_tokens, req.logprobs, choice, constraint, lora))
            for prompt in prompts
            for choice in range(req.n)
        ]
        return _prepared(req, requests, logprobs=req.logprobs is not None, token_ids=req.return_token_ids)

    def _logprobs(self, prepared: PreparedRequest, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not prepared.options["logprobs"]:
            return None
        return {
            "tokens": [lp.token for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{text: value for _, text, value in lp.top} for lp in logprobs],
            "text_offset": [],
        }

    def format_stream_start(self, prepared: PreparedRequest, choices: Sequence[Choice]) -> list[str]:
        return []

    def format_chunk(self, prepared: PreparedRequest, choice: Choice, delta: StreamDelta) -> list[str]:
        with_ids = prepared.options["token_ids"]
        if delta.finish_reason == "error":
            return []
        if not (delta.text or delta.finish_reason or delta.logprobs or with_ids and delta.token_ids):
            return []
        body: dict[str, Any] = {
            "index": choice.index,
            "text": delta.text,
            "logprobs": self._logprobs(prepared, delta.logprobs),
            "finish_reason": _finish_reason(choice) if delta.finish_reason is not None else None,
        }
        if with_ids:
            body["token_ids"] = list(delta.token_ids)
        return [sse(self._chunk(prepared, [body]))]

    def format_response(self, prepared: PreparedRequest, choices: Sequence[Choice]) -> dict[str, Any]:
        if prepared.options["token_ids"]:
            return self._response(
                prepared, "text_completion", choices, lambda c: {"text": c.text, "token_ids": c.token_ids}
            )
        return self._response(prepared, "text_completion", choices, lambda c: {"text": c.text})


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The legacy `prompt` field as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise invalid("prompt: must not be empty", "prompt")
    return prompts
