"""Tool calling in a chat template's own format, for templates that take `tools`: the template
renders the tools and the earlier calls and results (Hugging Face's message shapes), the engine
enforces the format with xgrammar's structural tag for it (`serve_app.engine.grammar`) and reads
it back (`serve_app.answers`).

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks after any text
  (Qwen2.5, Qwen3, Hermes, SmolLM3).
- `llama3_json`: `{"name": ..., "parameters": {...}}` objects after any text (Llama 3.1+).
- `mistral`: `[TOOL_CALLS]name[ARGS]{...}` per call (Mistral Small 3.2, Devstral, Magistral); its templates take
  call ids of 9 letters and digits only, so each id is written as 9 characters of its digest.
- `qwen3_coder`: `<tool_call>` blocks of `<function=name>` with one `<parameter=key>` per argument (Qwen3-Coder).
- `deepseek_v31`: `<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` in a run of calls (DeepSeek-V3.1),
  whose template takes no `tools`: they are described in the system message, as DeepSeek's model card does.
- `openai`: gpt-oss's harmony messages, a call being `<|channel|>commentary to=functions.name ...<|message|>{...}
  <|call|>` (`serve_app.engine.harmony` reads the channels); its template renders one call per assistant message.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from serve_app.http.tools.plan import (
    Prompt,
    ToolCallFormat,
    ToolPlan,
    Turn,
    arguments_value,
    ToolCall,
    call_names,
)


class _TemplateFormat(ToolCallFormat):
    """What every template format shares: the template renders the tools and the conversation."""

    def prompt(self, turns: Sequence[Turn], plan: ToolPlan | None) -> Prompt:
        names = call_names(turns)
        messages: list[dict[str, Any]] = []
        for turn in turns:
            message = turn.message(turn.role, turn.content)
            if turn.calls:
                message["tool_calls"] = [
                    {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments_value(call.arguments)}}
                    for call in turn.calls
                ]
            if turn.role == "tool":
                message["tool_call_id"] = turn.call_id
                message["name"] = turn.name or names.get(turn.call_id or "", "")
            messages.append(message)
        tools = [tool.as_openai() for tool in plan.tools] if plan is not None else None
        return Prompt(messages, tools)


class HermesFormat(_TemplateFormat):
    name = "hermes"


class Llama3JsonFormat(_TemplateFormat):
    name = "llama3_json"


class MistralFormat(_TemplateFormat):
    name = "mistral"

    def prompt(self, turns: Sequence[Turn], plan: ToolPlan | None) -> Prompt:
        return super().prompt([_with_mistral_ids(turn) for turn in turns], plan)


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _mistral_id(call_id: str) -> str:
    """A call id as Mistral's templates take it: 9 letters and digits (an id that is one stays as it is)."""
    return call_id if _MISTRAL_ID.fullmatch(call_id) else hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _with_mistral_ids(turn: Turn) -> Turn:
    calls = tuple(ToolCall(_mistral_id(call.id), call.name, call.arguments) for call in turn.calls)
    call_id = _mistral_id(turn.call_id) if turn.call_id is not None else None
    return replace(turn, calls=calls, call_id=call_id)


class Qwen3CoderFormat(_TemplateFormat):
    name = "qwen3_coder"


class DeepSeekV31Format(_TemplateFormat):
    """The template renders the calls and their results; the tools are described in the system message."""

    name = "deepseek_v31"

    def prompt(self, turns: Sequence[Turn], plan: ToolPlan | None) -> Prompt:
        rendered = super().prompt(turns, plan)
        if plan is None:
            return rendered
        messages = list(rendered.messages)
        described = _deepseek_tools(plan)
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{described}"}
        else:
            messages.insert(0, {"role": "system", "content": described})
        return Prompt(messages, None)


def _deepseek_tools(plan: ToolPlan) -> str:
    """The tools as DeepSeek-V3.1 is told of them: each one's name, description and parameters, then the format."""
    described = "".join(
        f"### {tool.name}\nDescription: {tool.description}\n\nParameters: {json.dumps(tool.parameters, ensure_ascii=False)}\n\n"
        for tool in plan.tools
    )
    return (
        "## Tools\nYou have access to the following tools:\n\n"
        f"{described}"
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>"
        "{additional_tool_calls}<｜tool▁calls▁end｜>\n\n"
        "Where:\n- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
        "- For multiple tool calls, chain them directly without separators or spaces"
    )


class HarmonyFormat(_TemplateFormat):
    """gpt-oss's: its template renders the first call of an assistant message only, and a tool result under the
    name of the call before it, so a turn of several calls goes to it as one message per call, each followed by its
    result. An assistant's thinking goes to it as `thinking`; beside calls, the template takes the thinking or the
    text (both become the analysis before the call): the two are joined."""

    name = "openai"

    def prompt(self, turns: Sequence[Turn], plan: ToolPlan | None) -> Prompt:
        rendered = super().prompt(_one_call_per_turn(turns), plan)
        return Prompt([_harmony_message(message) for message in rendered.messages], rendered.tools)


def _one_call_per_turn(turns: Sequence[Turn]) -> list[Turn]:
    """`turns` with each assistant turn of several calls split into one turn per call, its result after it."""
    out: list[Turn] = []
    index = 0
    while index < len(turns):
        turn = turns[index]
        index += 1
        if turn.role != "assistant" or len(turn.calls) < 2:
            out.append(turn)
            continue
        results: dict[str | None, list[Turn]] = {}
        while index < len(turns) and turns[index].role == "tool":
            results.setdefault(turns[index].call_id, []).append(turns[index])
            index += 1
        for position, call in enumerate(turn.calls):
            first = position == 0
            out.append(replace(turn, calls=(call,), content=turn.content if first else "", reasoning=turn.reasoning if first else None))
            out.extend(results.pop(call.id, []))
        out.extend(result for unmatched in results.values() for result in unmatched)  # answering no call of the turn
    return out


def _harmony_message(message: dict[str, Any]) -> dict[str, Any]:
    """A template message as gpt-oss's template reads it: the thinking as `thinking`, joined with the text beside
    calls."""
    message = dict(message)
    thinking = message.pop("reasoning_content", None)
    if message.get("tool_calls") and thinking and message.get("content"):
        thinking, message["content"] = f"{thinking}\n\n{message['content']}", ""
    if thinking is not None:
        message["thinking"] = thinking
    return message
