"""Tool calling in the generic format, for any chat template (as llama.cpp's server does for
templates that ignore tools): the tools are described in a system message, and the whole output
is one JSON value that a grammar enforces:

    {"tool_calls": [{"name": "...", "arguments": {...}}, ...]}   a call (each argument object
                                                                   matching its tool's schema)
    {"response": "..."}                                           a plain answer (`auto` only)

`required` and a named tool allow only calls (a named tool: only that one); parallel calls are
at most MAX_PARALLEL_CALLS (small models otherwise repeat a call until `max_tokens`), and
`parallel` false allows one. Earlier calls and their results go back into the conversation as that
JSON and as user messages, so every template renders them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from serve_app.engine.structured_output import StructuredOutput
from serve_app.http.tools.plan import (
    CallSegment,
    Prompt,
    Segment,
    TextSegment,
    ToolCall,
    ToolCallFormat,
    ToolPlan,
    Turn,
    arguments_value,
    call_names,
)
from serve_app.http.tools.scan import NAME, decode_name, string_so_far, value_end

MAX_PARALLEL_CALLS = 4


class GenericFormat(ToolCallFormat):
    def prompt(self, turns: Sequence[Turn], plan: ToolPlan | None) -> Prompt:
        names = call_names(turns)
        messages: list[dict[str, Any]] = []
        for turn in turns:
            if turn.role == "tool":
                messages.append({"role": "user", "content": _result_message(turn, names)})
            elif turn.calls:
                messages.append({"role": "assistant", "content": _calls_as_output(turn.calls)})
            else:
                messages.append({"role": turn.role, "content": turn.content})
        if plan is not None:
            described = _system_prompt(plan)
            if messages and messages[0]["role"] == "system":
                messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{described}"}
            else:
                messages.insert(0, {"role": "system", "content": described})
        return Prompt(messages)

    def constraint(self, plan: ToolPlan) -> StructuredOutput:
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in plan.tools
        ]
        most = MAX_PARALLEL_CALLS if plan.parallel else 1
        call_list = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "maxItems": most}
        with_calls = {
            "type": "object", "properties": {"tool_calls": call_list}, "required": ["tool_calls"],
            "additionalProperties": False,
        }
        if plan.mode != "auto":
            return StructuredOutput(json=with_calls, param="tools")
        plain = {
            "type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
            "additionalProperties": False,
        }
        return StructuredOutput(json={"anyOf": [with_calls, plain]}, param="tools")

    def segments(self, text: str, final: bool) -> list[Segment]:
        if (answer := _ANSWER.match(text)) is not None:
            return [TextSegment(string_so_far(text, answer.end()))]
        if (calls := _CALLS.match(text)) is None:
            return [TextSegment(text)] if final and text else []  # cut short before its first key
        segments: list[Segment] = []
        position = calls.end()
        while (header := _CALL_HEADER.match(text, position)) is not None:
            begin = header.end()
            end = value_end(text, begin)
            segments.append(CallSegment(decode_name(header.group("name")), text[begin:end], whole=end is not None))
            if end is None:
                break
            position = _CALL_CLOSER.match(text, end).end()  # type: ignore[union-attr]  # it matches the empty string
        return segments


_ANSWER = re.compile(r'\s*\{\s*"response"\s*:\s*"')
_CALLS = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[')
_CALL_HEADER = re.compile(rf'\s*\{{\s*"name"\s*:\s*{NAME}\s*,\s*"arguments"\s*:\s*')
_CALL_CLOSER = re.compile(r"\s*(?:\}\s*,?)?")


def _system_prompt(plan: ToolPlan) -> str:
    described = json.dumps(
        [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in plan.tools],
        ensure_ascii=False,
    )
    answer = (
        'Answer only with {"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]}.'
        if plan.mode != "auto"
        else 'To call tools, answer with {"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]}; '
        'otherwise answer with {"response": <your answer>}.'
    )
    return f"You can call these tools:\n{described}\n{answer}"


def _calls_as_output(calls: Sequence[ToolCall]) -> str:
    """An earlier turn's calls in the format the model answers in."""
    rendered = [{"name": call.name, "arguments": arguments_value(call.arguments)} for call in calls]
    return json.dumps({"tool_calls": rendered}, ensure_ascii=False)


def _result_message(turn: Turn, names: dict[str, str]) -> str:
    """A tool's result, as the user message that carries it back to the model."""
    name = turn.name or names.get(turn.call_id or "")
    who = f"{name} ({turn.call_id})" if name else turn.call_id
    return f"Result of the tool call {who}:\n{turn.content}"
