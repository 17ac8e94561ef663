"""Tool calling in a chat template's own format, for templates that take `tools`: the template
renders the tools and the earlier calls and results (Hugging Face's message shapes), the engine
enforces the format with xgrammar's structural tag for it, and the answer is read back here.

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks after any text
  (Qwen2.5, Qwen3, Hermes, SmolLM3).
- `llama3_json`: `{"name": ..., "parameters": {...}}` objects after any text (Llama 3.1+).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from serve_app.config import ToolFormat
from serve_app.engine.structured_output import (
    FunctionTool,
    StructuredOutput,
    ToolCallGrammar,
)
from serve_app.http.tools.plan import (
    CallSegment,
    Prompt,
    Segment,
    ToolCallFormat,
    ToolPlan,
    Turn,
    add_text,
    arguments_value,
    call_names,
)
from serve_app.http.tools.scan import NAME, decode_name, held_back, value_end


class _TemplateFormat(ToolCallFormat):
    """What every template format shares: the prompt, the grammar, and reading calls out of text
    (text runs until one of `markers`; a call is `header`, its arguments' JSON value, `closer`)."""

    name: ToolFormat
    markers: tuple[str, ...]
    header: re.Pattern[str]  # from a marker to the arguments' value; the tool's name in group `name`
    arguments_key: re.Pattern[str]  # the header's last key: a marker without it may still become a call
    closer: re.Pattern[str]  # what follows the arguments' value

    def prompt(self, turns: Sequence[Turn], plan: ToolPlan | None) -> Prompt:
        names = call_names(turns)
        messages: list[dict[str, Any]] = []
        for turn in turns:
            message: dict[str, Any] = {"role": turn.role, "content": turn.content}
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

    def constraint(self, plan: ToolPlan) -> StructuredOutput:
        grammar = ToolCallGrammar(
            format=self.name,
            tools=[FunctionTool(name=t.name, parameters=t.parameters) for t in plan.tools],
            mode=plan.mode,
            parallel=plan.parallel,
        )
        return StructuredOutput(tool_calls=grammar, param="tools")

    def segments(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        position = 0
        while True:
            start = self._next_marker(text, position)
            if start is None:
                rest = text[position:]
                add_text(segments, rest if final else rest[: len(rest) - held_back(rest, self.markers)])
                return segments
            add_text(segments, text[position:start])
            header = self.header.match(text, start)
            if header is None:
                if not final and self.arguments_key.search(text, start) is None:
                    return segments  # may still become a call
                add_text(segments, text[start])
                position = start + 1
                continue
            begin = header.end()
            end = value_end(text, begin)
            name = decode_name(header.group("name"))
            segments.append(CallSegment(name, text[begin:end], whole=end is not None))
            if end is None:
                return segments
            closer = self.closer.match(text, end)
            if closer is None and not final:
                return segments
            position = closer.end() if closer is not None else end

    def _next_marker(self, text: str, position: int) -> int | None:
        found = [i for i in (text.find(m, position) for m in self.markers) if i >= 0]
        return min(found, default=None)


class HermesFormat(_TemplateFormat):
    name = "hermes"
    markers = ("<tool_call>",)
    header = re.compile(rf'<tool_call>\s*\{{\s*"name"\s*:\s*{NAME}\s*,\s*"arguments"\s*:\s*')
    arguments_key = re.compile(r'"arguments"\s*:')
    closer = re.compile(r"\s*\}\s*</tool_call>")


class Llama3JsonFormat(_TemplateFormat):
    name = "llama3_json"
    markers = ("<|python_tag|>", '{"name"')
    header = re.compile(rf'(?:<\|python_tag\|>\s*)?\{{\s*"name"\s*:\s*{NAME}\s*,\s*"parameters"\s*:\s*')
    arguments_key = re.compile(r'"parameters"\s*:')
    closer = re.compile(r"\s*\}\s*;?")
