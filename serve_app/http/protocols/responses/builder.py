"""The Responses builder and its formatter: response objects with `message` and `function_call` output items, and
the streamed event sequence (`response.created` ... `response.completed`, each with its `sequence_number`). The
builder is made per request (it continues `previous`, when given)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from serve_app.http.protocols.base import DEFAULT_LIMITS, ResponseBuilder, ResponseFormatter, sse
from serve_app.http.protocols.errors import ProtocolError
from serve_app.http.protocols.fields import refuse_fields, validate_body
from serve_app.http.protocols.limits import RequestLimits
from serve_app.http.protocols.openai import ERRORS as OPENAI_ERRORS
from serve_app.http.protocols.openai.schema import retained
from serve_app.http.protocols.prepared import Choice, PreparedRequest, total_usage
from serve_app.http.protocols.reasoning import from_effort
from serve_app.http.protocols.responses.schema import ACCEPTED, UNSUPPORTED, FunctionChoice, ResponsesRequest
from serve_app.http.response_store import StoredResponse
from serve_app.http.served_models import adapter_of
from serve_app.http.tools import format_for
from serve_app.http.tools.plan import ToolCall, Turn, read_answer, tool_answer_reader
from serve_app.http.tools.stream import (
    ArgumentsDelta,
    CallStarted,
    TextDelta,
    ToolStream,
    ToolStreamEvent,
)
from serve_app.wire.model_card import ModelInfo
from serve_app.wire.outputs import StreamDelta
from serve_app.wire.requests import GenerateRequest, SamplingParams, StructuredOutput


def _usage(prepared: PreparedRequest, choice: Choice) -> dict[str, Any]:
    usage = total_usage(prepared, [choice])
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message", "id": item_id, "status": status, "role": "assistant",
        "content": [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    """A reasoning output item: the model's thinking as its `reasoning_text` (no summary is written)."""
    return {
        "type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "summary": [], "status": status,
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def _call_item(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": call.id, "name": call.name,
        "arguments": call.arguments, "status": "completed",
    }


def _status(choice: Choice) -> str:
    """A finished choice's response status: cut short by `max_output_tokens`, or whole."""
    return "incomplete" if choice.finish_reason == "length" else "completed"


class ResponsesBuilder(ResponseBuilder):
    """`POST /v1/responses`, for one request (continuing `previous`, when given)."""

    errors = OPENAI_ERRORS
    max_tokens_param = "max_output_tokens"
    messages_param = "input"

    def __init__(self, previous: StoredResponse | None = None) -> None:
        self.previous = previous

    def prepare(self, body: Any, model: ModelInfo, limits: RequestLimits = DEFAULT_LIMITS) -> ResponsesFormatter:
        body = refuse_fields(body, UNSUPPORTED, ACCEPTED)
        req: ResponsesRequest = validate_body(ResponsesRequest, body, limits.unknown_fields)
        lora = adapter_of(model, req.model)
        previous_id = self.previous.response["id"] if self.previous is not None else None
        if req.previous_response_id != previous_id:
            raise ProtocolError(
                "not_found", f"previous_response_id: no response {req.previous_response_id!r}", "previous_response_id"
            )
        tools, tool_plan = format_for(model.tool_format), req.tool_plan()
        turns = req.turns(self.previous.turns if self.previous else ())
        system = [Turn("system", req.instructions)] if req.instructions else []
        prompt = tools.prompt([*system, *turns], tool_plan)
        constraint = req.output_constraint(tools, tool_plan)
        thinking = from_effort(model, req.reasoning.effort if req.reasoning is not None else None, "reasoning.effort")
        request = GenerateRequest(
            messages=prompt.messages,
            tools=prompt.tools,
            max_tokens=req.max_output_tokens,
            sampling=SamplingParams(temperature=req.temperature, top_p=req.top_p),
            structured_output=constraint,
            max_string_tokens=req.max_string_tokens,
            lora=lora,
            client_salt=req.prompt_cache_key,
            cache_prefix=retained(req.prompt_cache_retention),
            thinking_token_budget=thinking.budget,
            chat_template_kwargs=thinking.template_kwargs(None),
        )
        end_user = req.safety_identifier or req.user
        prepared = PreparedRequest(requests=[request], stream=req.stream, model=req.model, end_user=end_user)
        return ResponsesFormatter(prepared, req, turns, constraint if tool_plan is not None else None)


class ResponsesFormatter(ResponseFormatter):
    """A response: its streamed events, each output item opened as the answer reaches it and closed as the next
    opens, or the whole response object; and, once it is whole, what is kept of it (`finished`)."""

    def __init__(
        self, prepared: PreparedRequest, req: ResponsesRequest, turns: list[Turn], tools: StructuredOutput | None
    ) -> None:
        super().__init__(prepared)
        self.finished: StoredResponse | None = None  # what was answered, once it is whole
        self._req = req
        self._turns = turns  # the conversation so far, this request's input last
        self._constraint = tools  # a tool-mode answer's grammar
        self._answer = ToolStream(tool_answer_reader(tools), "call_") if tools is not None else None  # its events
        self._sequence = 0
        self._items: list[dict[str, Any]] = []  # the output items streamed so far, the open one last
        self._closing: list[str] = []  # the events that closed them, once the stream's end is built

    # The response object.

    def _response(self, status: str, output: list[dict[str, Any]], choice: Choice | None) -> dict[str, Any]:
        req, prepared = self._req, self.prepared
        text_format = req.text.format if req.text is not None and req.text.format is not None else None
        tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionChoice) else req.tool_choice or "auto"
        return {
            "id": "resp_" + prepared.id,
            "object": "response",
            "created_at": prepared.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": prepared.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning is not None else None, "summary": None},
            "store": req.store,
            "temperature": req.temperature,
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}},
            "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in req.function_tools()],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": _usage(prepared, choice) if choice is not None else None,
            "user": req.user,
            "safety_identifier": req.safety_identifier,
            "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention,
            "metadata": req.metadata or {},
        }

    def _output(self, choice: Choice) -> tuple[str, list[dict[str, Any]]]:
        """(status, output items) of a finished choice: its thinking, then its message or calls."""
        status = _status(choice)
        thinking = [_reasoning_item(choice.reasoning, status)] if choice.reasoning else []
        if self._constraint is None:
            return status, [*thinking, _message_item(_message_id(), choice.text, status)]
        parsed = read_answer(self._constraint, choice.text, choice.complete, "call_")
        items = [_message_item(_message_id(), parsed.content, status)] if parsed.content else []
        items += [_call_item(call) for call in parsed.calls]
        return status, [*thinking, *(items or [_message_item(_message_id(), "", status)])]

    def _finish(self, choice: Choice, status: str, items: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole response, kept (with the conversation it ends) for `previous_response_id`."""
        response = self._response(status, items, choice)
        text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
        calls = tuple(ToolCall(i["call_id"], i["name"], i["arguments"]) for i in items if i["type"] == "function_call")
        reasoning = "".join(i["content"][0]["text"] for i in items if i["type"] == "reasoning") or None
        self.finished = StoredResponse(response, (*self._turns, Turn("assistant", text, calls=calls, reasoning=reasoning)))
        return response

    def response(self, choices: Sequence[Choice]) -> dict[str, Any]:
        return self._finish(choices[0], *self._output(choices[0]))

    # The event stream.

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse(event, kind)

    def stream_start(self, choices: Sequence[Choice]) -> list[str]:
        started = self._response("in_progress", [], None)
        return [self._event("response.created", response=started), self._event("response.in_progress", response=started)]

    def chunk(self, choice: Choice, delta: StreamDelta) -> list[str]:
        """The events of the answer's next delta: each item opened as the answer reaches it (its thinking, its
        text, each whole call) and the one before it closed."""
        if delta.finish_reason == "error":
            return []
        events = self._add_reasoning(delta.reasoning) if delta.reasoning else []
        if self._answer is None:
            settled: list[ToolStreamEvent] = [TextDelta(delta.text)] if delta.text else []
        else:
            settled = self._answer.feed(delta.text)
            if delta.finish_reason is not None:
                settled += self._answer.finish(choice.complete)
        for event in settled:
            match event:
                case TextDelta(piece):
                    if not self._items or self._items[-1]["type"] != "message":
                        events += self._close_item("completed") + self._open_message()
                    events += self._add_text(piece)
                case CallStarted(_, call_id, name):
                    item = {**_call_item(ToolCall(call_id, name, "")), "status": "in_progress"}
                    events += self._close_item("completed") + self._open(item)
                case ArgumentsDelta(_, piece):
                    self._items[-1]["arguments"] += piece
                    events.append(self._event(
                        "response.function_call_arguments.delta", item_id=self._items[-1]["id"],
                        output_index=len(self._items) - 1, delta=piece,
                    ))
        return events

    def stream_end(self, choices: Sequence[Choice]) -> list[str]:
        choice = choices[0]
        if choice.finish_reason == "error":  # the items closed by an end already built stay closed before it
            failed = self._response("failed", [], choice)
            failed["error"] = {"code": "server_error", "message": choice.error or "generation failed"}
            return [*self._closing, self._event("response.failed", response=failed)]
        status = _status(choice)
        answered = any(item["type"] != "reasoning" for item in self._items)
        events = [] if answered else self._close_item(status) + self._open_message()
        events += self._close_item(status)
        self._closing = events
        response = self._finish(choice, status, self._items)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=response)]

    def _open(self, item: dict[str, Any]) -> list[str]:
        self._items.append(item)
        return [self._event("response.output_item.added", output_index=len(self._items) - 1, item=item)]

    def _open_message(self) -> list[str]:
        item = _message_item(_message_id(), "", "in_progress")
        events = self._open(item)
        item["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
        return [*events, self._event(
            "response.content_part.added", item_id=item["id"], output_index=len(self._items) - 1, content_index=0,
            part=item["content"][0],
        )]

    def _add_reasoning(self, piece: str) -> list[str]:
        """Thinking text, in the reasoning item (opened first where another item is open)."""
        events = []
        if not self._items or self._items[-1]["type"] != "reasoning":
            events = self._close_item("completed") + self._open(_reasoning_item("", "in_progress"))
        item = self._items[-1]
        item["content"][0]["text"] += piece
        return [*events, self._event(
            "response.reasoning_text.delta", item_id=item["id"], output_index=len(self._items) - 1, content_index=0,
            delta=piece,
        )]

    def _add_text(self, piece: str) -> list[str]:
        item = self._items[-1]
        item["content"][0]["text"] += piece
        return [self._event(
            "response.output_text.delta", item_id=item["id"], output_index=len(self._items) - 1, content_index=0,
            delta=piece, logprobs=[],
        )]

    def _close_item(self, status: str) -> list[str]:
        """Close the open item (if any) with `status` (a call that is whole: `completed`)."""
        if not self._items or self._items[-1]["status"] != "in_progress":
            return []
        item, index = self._items[-1], len(self._items) - 1
        if item["type"] == "function_call":  # a call streams once it is whole
            item["status"] = "completed"
            return [
                self._event(
                    "response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    name=item["name"], arguments=item["arguments"],
                ),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        item["status"] = status
        part = item["content"][0]
        if item["type"] == "reasoning":
            return [
                self._event(
                    "response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                    text=part["text"],
                ),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        return [
            self._event(
                "response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                text=part["text"], logprobs=[],
            ),
            self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]
