"""The OpenAI builders and their formatters: chat completions and legacy completions, streamed and not; OpenAI's
error shape."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from serve_app.http.protocols.base import DEFAULT_LIMITS, ResponseBuilder, ResponseFormatter, sse
from serve_app.http.protocols.errors import ErrorFormat, ProtocolError, invalid
from serve_app.http.protocols.fields import refuse_fields, validate_body
from serve_app.http.protocols.limits import RequestLimits
from serve_app.http.protocols.openai.schema import (
    ACCEPTED,
    COMPLETIONS_ACCEPTED,
    COMPLETIONS_UNSUPPORTED,
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    prompt_list,
    retained,
)
from serve_app.http.protocols.prepared import Choice, PreparedRequest, total_usage
from serve_app.http.protocols.reasoning import from_effort
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
from serve_app.wire.model_card import ModelInfo
from serve_app.wire.outputs import StreamDelta, TokenLogprob, Usage
from serve_app.wire.requests import GenerateRequest, StructuredOutput


_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "too_large": "invalid_request_error",
    "unsupported_media_type": "invalid_request_error",
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
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def _prepared(req: SamplingFields, requests: list[GenerateRequest], end_user: str | None) -> PreparedRequest:
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options: only allowed when stream is true", "stream_options")
    prepared = PreparedRequest(
        requests=requests,
        stream=req.stream,
        model=req.model,
        choices_per_prompt=req.n,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        end_user=end_user,
    )
    if req.request_id is not None:
        prepared.id = req.request_id
    return prepared


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


class _OpenAIFormatter(ResponseFormatter):
    """What both OpenAI routes' answers share: usage chunks, the closing `[DONE]`, the whole body's frame."""

    object_chunk: str
    id_prefix: str

    def __init__(self, prepared: PreparedRequest, logprobs: bool) -> None:
        super().__init__(prepared)
        self.logprobs = logprobs  # the client asked for them

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        prepared = self.prepared
        chunk = {
            "id": self._id(),
            "object": self.object_chunk,
            "created": prepared.created,
            "model": prepared.model,
            "choices": choices,
        }
        if prepared.include_usage:
            chunk["usage"] = None
        return chunk

    def stream_end(self, choices: Sequence[Choice]) -> list[str]:
        events = []
        failed = next((c for c in choices if c.finish_reason == "error"), None)
        if failed is not None:
            events.append(sse(openai_error(ProtocolError("internal", failed.error or "generation failed"))))
        elif self.prepared.include_usage:
            chunk = self._chunk([])
            chunk["usage"] = _usage_json(total_usage(self.prepared, choices))
            events.append(sse(chunk))
        events.append(sse("[DONE]"))
        return events

    def _id(self) -> str:
        return self.id_prefix + self.prepared.id

    @abstractmethod
    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None: ...

    def _response(
        self, object_name: str, choices: Sequence[Choice], content: Callable[[Choice], dict[str, Any]]
    ) -> dict[str, Any]:
        """The non-streaming body: each choice's `content` fields (which may set its finish reason) and logprobs."""
        prepared = self.prepared
        return {
            "id": self._id(),
            "object": object_name,
            "created": prepared.created,
            "model": prepared.model,
            "choices": [
                {
                    "index": c.index,
                    "logprobs": self._logprobs(c.logprobs),
                    "finish_reason": _finish_reason(c),
                    **content(c),
                }
                for c in choices
            ],
            "usage": _usage_json(total_usage(prepared, choices)),
        }


class ChatCompletionsBuilder(ResponseBuilder):
    """`POST /v1/chat/completions`."""

    errors = ERRORS

    def prepare(self, body: Any, model: ModelInfo, limits: RequestLimits = DEFAULT_LIMITS) -> ChatFormatter:
        body = refuse_fields(body, UNSUPPORTED, ACCEPTED)
        req: ChatCompletionRequest = validate_body(ChatCompletionRequest, body, limits.unknown_fields)
        lora = adapter_of(model, req.model)
        tools, tool_plan = format_for(model.tool_format), req.tool_plan()
        prompt = req.prompt(tools, tool_plan)
        constraint = req.output_constraint(tools, tool_plan)
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        limits.check_choices(req.n)
        thinking = from_effort(model, req.reasoning_effort, "reasoning_effort", req.thinking_token_budget)
        requests = [
            GenerateRequest(
                messages=prompt.messages, tools=prompt.tools, cache_prefix=retained(req.prompt_cache_retention),
                chat_template_kwargs=thinking.template_kwargs(req.chat_template_kwargs),
                thinking_token_budget=thinking.budget,
                **req.engine_fields(max_tokens, logprobs, choice, constraint, lora),
            )
            for choice in range(req.n)
        ]
        tool_answer = constraint if tool_plan is not None else None
        prepared = _prepared(req, requests, req.safety_identifier or req.user)
        return ChatFormatter(prepared, req.logprobs, tool_answer, req.include_reasoning)


class ChatFormatter(_OpenAIFormatter):
    """A chat completion: `chat.completion` chunks, or the whole `chat.completion`."""

    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(
        self, prepared: PreparedRequest, logprobs: bool, tools: StructuredOutput | None, include_reasoning: bool = True
    ) -> None:
        super().__init__(prepared, logprobs)
        self.tools = tools  # a tool-mode answer's grammar
        self.include_reasoning = include_reasoning  # the thinking goes out as `reasoning_content`
        self.tool_streams: dict[int, ToolStream] = {}  # a tool-mode answer's reading, per choice, as it streams

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
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

    def stream_start(self, choices: Sequence[Choice]) -> list[str]:
        return [
            sse(
                self._chunk(
                    [
                        {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                        for c in choices
                    ],
                )
            )
        ]

    def chunk(self, choice: Choice, delta: StreamDelta) -> list[str]:
        events = []
        if delta.reasoning and self.include_reasoning:
            body = {"index": choice.index, "delta": {"reasoning_content": delta.reasoning}, "logprobs": None, "finish_reason": None}
            events.append(sse(self._chunk([body])))
        if self.tools is not None:
            return events + self._tool_chunks(self.tools, choice, delta)
        if delta.text or delta.logprobs and self.logprobs:
            events.append(
                sse(
                    self._chunk(
                        [
                            {
                                "index": choice.index,
                                "delta": {"content": delta.text},
                                "logprobs": self._logprobs(delta.logprobs),
                                "finish_reason": None,
                            }
                        ],
                    )
                )
            )
        if delta.finish_reason is not None and delta.finish_reason != "error":
            events.append(
                sse(self._chunk([{"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": _finish_reason(choice)}]))
            )
        return events

    def response(self, choices: Sequence[Choice]) -> dict[str, Any]:
        tools = self.tools
        if tools is not None:
            return self._response("chat.completion", choices, lambda c: self._with_reasoning(c, _tool_message(tools, c)))
        return self._response(
            "chat.completion", choices, lambda c: self._with_reasoning(c, {"message": {"role": "assistant", "content": c.text}})
        )

    def _with_reasoning(self, choice: Choice, content: dict[str, Any]) -> dict[str, Any]:
        """A choice's message fields with its thinking as `reasoning_content`, where it thought."""
        if choice.reasoning and self.include_reasoning:
            content["message"]["reasoning_content"] = choice.reasoning
        return content

    def _tool_chunks(self, tools: StructuredOutput, choice: Choice, delta: StreamDelta) -> list[str]:
        """A tool-mode choice streams as it is read: its text as content, each whole call's id, type and
        name, then its arguments (as OpenAI streams them)."""
        if delta.finish_reason == "error":
            return []
        stream = self.tool_streams.get(choice.index)
        if stream is None:
            stream = self.tool_streams[choice.index] = ToolStream(tool_answer_reader(tools), "call_")

        def chunk(delta_body: dict[str, Any], finish_reason: str | None = None) -> str:
            body = {"index": choice.index, "delta": delta_body, "logprobs": None, "finish_reason": finish_reason}
            return sse(self._chunk([body]))

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


class CompletionsBuilder(ResponseBuilder):
    """`POST /v1/completions` (legacy): prompts as text or token ids, several per request."""

    errors = ERRORS

    def prepare(self, body: Any, model: ModelInfo, limits: RequestLimits = DEFAULT_LIMITS) -> CompletionFormatter:
        body = refuse_fields(body, COMPLETIONS_UNSUPPORTED, COMPLETIONS_ACCEPTED)
        req: CompletionRequest = validate_body(CompletionRequest, body, limits.unknown_fields)
        lora = adapter_of(model, req.model)
        prompts = prompt_list(req.prompt, "prompt")
        if req.echo and req.logprobs is not None:
            raise invalid("echo: not with logprobs (the prompt's logprobs are not computed)", "echo")
        if req.echo and not all(isinstance(p, str) for p in prompts):
            raise invalid("echo: only with text prompts", "echo")
        limits.check_choices(req.n, len(prompts))
        constraint = req.structured_output()
        requests = [
            GenerateRequest(
                prompt=prompt, suffix=req.suffix,
                **req.engine_fields(req.max_tokens, req.logprobs, choice, constraint, lora),
            )
            for prompt in prompts
            for choice in range(req.n)
        ]
        echoed = [str(r.prompt) for r in requests] if req.echo else None
        prepared = _prepared(req, requests, req.user)
        return CompletionFormatter(prepared, req.logprobs is not None, req.return_token_ids, echoed)


class CompletionFormatter(_OpenAIFormatter):
    """A legacy completion: `text_completion` chunks, or the whole `text_completion`."""

    object_chunk = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, prepared: PreparedRequest, logprobs: bool, token_ids: bool, echoed: list[str] | None) -> None:
        super().__init__(prepared, logprobs)
        self.token_ids = token_ids  # `return_token_ids`: each choice's token ids with its text
        self.echoed = echoed  # `echo`: each choice's prompt, before its text
        self.started: set[int] = set()  # the choices whose first chunk has gone

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {
            "tokens": [lp.token for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{text: value for _, text, value in lp.top} for lp in logprobs],
            "text_offset": [],
        }

    def stream_start(self, choices: Sequence[Choice]) -> list[str]:
        return []

    def chunk(self, choice: Choice, delta: StreamDelta) -> list[str]:
        with_ids = self.token_ids
        if delta.finish_reason == "error":
            return []
        text = delta.text
        if self.echoed is not None and choice.index not in self.started:
            self.started.add(choice.index)
            text = self.echoed[choice.index] + text
        if not (text or delta.finish_reason or delta.logprobs or with_ids and delta.token_ids):
            return []
        body: dict[str, Any] = {
            "index": choice.index,
            "text": text,
            "logprobs": self._logprobs(delta.logprobs),
            "finish_reason": _finish_reason(choice) if delta.finish_reason is not None else None,
        }
        if with_ids:
            body["token_ids"] = list(delta.token_ids)
        return [sse(self._chunk([body]))]

    def response(self, choices: Sequence[Choice]) -> dict[str, Any]:
        echoed = self.echoed

        def content(choice: Choice) -> dict[str, Any]:
            text = echoed[choice.index] + choice.text if echoed is not None else choice.text
            return {"text": text, "token_ids": choice.token_ids} if self.token_ids else {"text": text}

        return self._response("text_completion", choices, content)
