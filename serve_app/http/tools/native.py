"""Tool calling in a chat template's own format, for templates that take `tools`: the template
renders the tools and the earlier calls and results (Hugging Face's message shapes), the engine
enforces the format with xgrammar's structural tag for it (`serve_app.engine.grammar`) and reads
it back (`serve_app.engine.answer_reader`).

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks after any text
  (Qwen2.5, Qwen3, Hermes, SmolLM3).
- `llama3_json`: `{"name": ..., "parameters": {...}}` objects after any text (Llama 3.1+).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from serve_app.http.tools.plan import (
    Prompt,
    ToolCallFormat,
    ToolPlan,
    Turn,
    arguments_value,
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
