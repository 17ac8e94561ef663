"""Tool calling in the generic format, for any chat template (as llama.cpp's server does for
templates that ignore tools): the tools are described in a system message, and the whole output
is one JSON value that a grammar enforces (`serve_app.engine.grammar`):

    {"tool_calls": [{"name": "...", "arguments": {...}}, ...]}   a call (each argument object
                                                                   matching its tool's schema)
    {"response": "..."}                                           a plain answer (`auto` only; with a
                                                                   response format, its JSON)

`required` and a named tool allow only calls (a named tool: only that one); parallel calls are
at most MAX_PARALLEL_CALLS, and `parallel` false allows one. Earlier calls and their results go
back into the conversation as that JSON and as user messages, so every template renders them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from serve_app.http.tools.plan import (
    Prompt,
    ToolCall,
    ToolCallFormat,
    ToolPlan,
    Turn,
    arguments_value,
    call_names,
)


class GenericFormat(ToolCallFormat):
    name = "generic"

    def prompt(self, turns: Sequence[Turn], plan: ToolPlan | None) -> Prompt:
        names = call_names(turns)
        messages: list[dict[str, Any]] = []
        for turn in turns:
            if turn.role == "tool":
                messages.append({"role": "user", "content": _result_message(turn, names)})
            elif turn.calls:
                messages.append({"role": "assistant", "content": _calls_as_output(turn.calls)})
            else:
                messages.append(turn.message(turn.role, turn.content))
        if plan is not None:
            described = _system_prompt(plan)
            if messages and messages[0]["role"] == "system":
                messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{described}"}
            else:
                messages.insert(0, {"role": "system", "content": described})
        return Prompt(messages)


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
