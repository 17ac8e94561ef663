"""Tool calling in the generic format, for any chat template (as llama.cpp's server does for
templates that ignore tools): the tools are described in a system message, and the whole output
is one JSON value that a grammar enforces:

    {"tool_calls": [{"name": "...", "arguments": {...}}, ...]}   a call (each argument object
                                                                   matching its tool's schema)
    {"response": "..."}                                           a plain answer (`auto` only)

`required` and a named tool allow only calls (a named tool: only that one); parallel calls are
at most MAX_PARALLEL_CALLS (small models otherwise repeat a call until `max_tokens`), and
`parallel` false allows one. Earlier calls and their results go back into the conversation as that JSON and
as user messages, so every template renders them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from serve_app.engine.structured_output import StructuredOutput
from serve_app.http.protocols.errors import invalid

ToolMode = Literal["auto", "required", "named"]
MAX_PARALLEL_CALLS = 4


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass(frozen=True)
class ParsedOutput:
    """What a tool-mode output says: calls, or a plain answer (or the raw text, when it was cut short)."""

    calls: tuple[ToolCall, ...]
    content: str | None


def choose(
    tools: list[ToolSpec], choice: Literal["none", "auto", "required", "named"] | None, name: str | None = None
) -> tuple[ToolMode | None, list[ToolSpec]]:
    """How a request may call its tools, and which: (None, []) when it calls none. `choice` None is the
    APIs' default (`auto` with tools); `named` calls the tool `name`."""
    if choice is not None and not tools:
        raise invalid("tool_choice: give it with tools", "tool_choice")
    if not tools or choice == "none":
        return None, []
    if choice == "named":
        chosen = [tool for tool in tools if tool.name == name]
        if not chosen:
            raise invalid(f"tool_choice: no tool is named {name!r}", "tool_choice")
        return "named", chosen
    return choice or "auto", tools


def new_call_id(prefix: str = "call_") -> str:
    """A call id as the API names them: `call_...` (OpenAI), `toolu_...` (Anthropic)."""
    return prefix + uuid.uuid4().hex[:24]


def system_prompt(tools: list[ToolSpec], mode: ToolMode) -> str:
    described = json.dumps(
        [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools], ensure_ascii=False
    )
    answer = (
        'Answer only with {"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]}.'
        if mode != "auto"
        else 'To call tools, answer with {"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]}; '
        'otherwise answer with {"response": <your answer>}.'
    )
    return f"You can call these tools:\n{described}\n{answer}"


def output_constraint(tools: list[ToolSpec], mode: ToolMode, parallel: bool) -> StructuredOutput:
    """The grammar of a tool-mode answer, as a JSON schema."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    call_list = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1}
    with_calls = {
        "type": "object", "properties": {"tool_calls": call_list}, "required": ["tool_calls"], "additionalProperties": False,
    }
    if mode != "auto":
        return StructuredOutput(json=with_calls, param="tools")
    plain = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"], "additionalProperties": False}
    return StructuredOutput(json={"anyOf": [with_calls, plain]}, param="tools")


def parse_output(text: str, id_prefix: str = "call_") -> ParsedOutput:
    """Calls or an answer from a finished tool-mode output; text that is not whole JSON stays as it is."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return ParsedOutput((), text)
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        calls = tuple(
            ToolCall(new_call_id(id_prefix), call["name"], json.dumps(call["arguments"], ensure_ascii=False))
            for call in value["tool_calls"]
        )
        return ParsedOutput(calls, None)
    if isinstance(value, dict) and isinstance(value.get("response"), str):
        return ParsedOutput((), value["response"])
    return ParsedOutput((), text)


def calls_as_output(calls: list[tuple[str, str]]) -> str:
    """An earlier turn's calls ((name, arguments JSON) pairs) in the format the model answers in."""
    rendered = []
    for name, arguments in calls:
        try:
            parsed: Any = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = arguments
        rendered.append({"name": name, "arguments": parsed})
    return json.dumps({"tool_calls": rendered}, ensure_ascii=False)


def result_message(call_id: str, name: str | None, content: str) -> str:
    """A tool's result, as the user message that carries it back to the model."""
    who = f"{name} ({call_id})" if name else call_id
    return f"Result of the tool call {who}:\n{content}"
