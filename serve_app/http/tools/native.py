"""Tool calling in a chat template's own format, for templates that take `tools`: the template
renders the tools and the earlier calls and results (Hugging Face's message shapes), the engine
enforces the format with xgrammar's structural tag for it, and the answer is read back here.

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks after any text
  (Qwen2.5, Qwen3, Hermes, SmolLM3).
- `llama3_json`: `{"name": ..., "parameters": {...}}` objects after any text (Llama 3.1+).
"""

from __future__ import annotations

import json
import re
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

from serve_app.config import ToolFormat
from serve_app.engine.structured_output import (
    FunctionTool,
    StructuredOutput,
    ToolCallGrammar,
)
from serve_app.http.tools.plan import (
    ParsedOutput,
    Prompt,
    ToolCall,
    ToolCallFormat,
    ToolPlan,
    Turn,
    arguments_value,
    call_names,
    new_call_id,
)


class _TemplateFormat(ToolCallFormat):
    """What every template format shares: the prompt and the grammar; subclasses find the calls."""

    name: ToolFormat
    arguments_key: str

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

    def parse(self, text: str, id_prefix: str) -> ParsedOutput:
        calls, rest = [], []
        position = 0
        for start, end, value in self._calls(text):
            if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
                return ParsedOutput((), text)
            arguments = value.get(self.arguments_key, {})
            calls.append(ToolCall(new_call_id(id_prefix), value["name"], json.dumps(arguments, ensure_ascii=False)))
            rest.append(text[position:start])
            position = end
        if not calls:
            return ParsedOutput((), text)
        rest.append(text[position:])
        content = "".join(rest).strip(" \n;")
        return ParsedOutput(tuple(calls), content or None)

    @abstractmethod
    def _calls(self, text: str) -> Iterator[tuple[int, int, Any]]:
        """(start, end, decoded JSON or None) of each call in `text`."""


class HermesFormat(_TemplateFormat):
    name = "hermes"
    arguments_key = "arguments"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def _calls(self, text: str) -> Iterator[tuple[int, int, Any]]:
        for match in self._CALL.finditer(text):
            yield match.start(), match.end(), _loads(match.group(1))


class Llama3JsonFormat(_TemplateFormat):
    name = "llama3_json"
    arguments_key = "parameters"
    _START = re.compile(r'(<\|python_tag\|>)?\{"name"')

    def _calls(self, text: str) -> Iterator[tuple[int, int, Any]]:
        decoder = json.JSONDecoder()
        position = 0
        while (match := self._START.search(text, position)) is not None:
            begin = match.start() + len(match.group(1) or "")
            try:
                value, end = decoder.raw_decode(text, begin)
            except json.JSONDecodeError:
                return
            yield match.start(), end, value
            position = end


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
