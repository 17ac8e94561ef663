"""What a request may call and how: the tools, the choice (`auto`, `required`, one named tool) and
parallel calls, the conversation in a shape both APIs map onto (`Turn`), the interface of a
tool-call format (`ToolCallFormat`: how it prompts, what grammar it enforces), and a finished
answer read into text and calls (`read_answer`)."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from serve_app.answers.by_format import tool_reader
from serve_app.answers.reader import AnswerReader, CallPart, TextPart
from serve_app.http.protocols.errors import invalid
from serve_app.wire.model_card import ToolFormat
from serve_app.wire.requests import FunctionTool, StructuredOutput, ToolCallGrammar

ToolMode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's function-tool shape, which chat templates take."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolPlan:
    """A request that may call tools: how (`mode`), which, and whether several calls at once."""

    mode: ToolMode
    tools: tuple[ToolSpec, ...]
    parallel: bool


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass(frozen=True)
class ParsedOutput:
    """What a tool-mode output says: its calls, and its text (None when there is none)."""

    calls: tuple[ToolCall, ...]
    content: str | None


@dataclass(frozen=True)
class Turn:
    """One message of a conversation, whichever API sent it."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    calls: tuple[ToolCall, ...] = ()  # an assistant turn's tool calls
    call_id: str | None = None  # the call a tool turn answers
    name: str | None = None  # that call's tool, where the conversation names it
    author: str | None = None  # the participant's name (OpenAI's message `name`), given to the template
    reasoning: str | None = None  # an assistant turn's thinking, given to the template as `reasoning_content`

    def message(self, role: str, content: str) -> dict[str, Any]:
        """A template message of this turn: `role` and `content`, its author's `name` and its thinking where it has them."""
        message: dict[str, Any] = {"role": role, "content": content}
        if self.author:
            message["name"] = self.author
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        return message


@dataclass(frozen=True)
class Prompt:
    """What the engine's chat template gets: messages, and the tools where the template takes them."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


def plan(
    tools: Sequence[ToolSpec],
    choice: Literal["none", "auto", "required", "named"] | None,
    name: str | None = None,
    parallel: bool = True,
) -> ToolPlan | None:
    """How a request may call its tools; None when it calls none. `choice` None is the APIs' default
    (`auto` with tools); `named` calls the tool `name`, once."""
    if choice is not None and not tools:
        raise invalid("tool_choice: give it with tools", "tool_choice")
    if not tools or choice == "none":
        return None
    if choice == "named":
        chosen = tuple(tool for tool in tools if tool.name == name)
        if not chosen:
            raise invalid(f"tool_choice: no tool is named {name!r}", "tool_choice")
        return ToolPlan("named", chosen, parallel=False)
    return ToolPlan(choice or "auto", tuple(tools), parallel)


def new_call_id(prefix: str = "call_") -> str:
    """A call id as the API names them: `call_...` (OpenAI), `toolu_...` (Anthropic)."""
    return prefix + uuid.uuid4().hex[:24]


def arguments_value(arguments: str) -> Any:
    """A call's arguments as a conversation carries them back: the object (or the text, when it is not JSON)."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def call_names(turns: Sequence[Turn]) -> dict[str, str]:
    """Call id -> tool name, over a conversation's earlier calls."""
    return {call.id: call.name for turn in turns for call in turn.calls}


class ToolCallFormat(ABC):
    """How tools reach a model and how its calls come back."""

    name: ToolFormat

    @abstractmethod
    def prompt(self, turns: Sequence[Turn], plan: ToolPlan | None) -> Prompt:
        """The conversation (earlier calls and results included) for the chat template."""

    def constraint(self, plan: ToolPlan, answer_schema: dict[str, Any] | None = None) -> StructuredOutput:
        """The grammar an answer under `plan` is decoded with; `answer_schema`: what an `auto` answer that
        calls nothing must match (a response format's JSON schema)."""
        grammar = ToolCallGrammar(
            format=self.name,
            tools=[FunctionTool(name=t.name, parameters=t.parameters) for t in plan.tools],
            mode=plan.mode,
            parallel=plan.parallel,
            answer_schema=answer_schema if plan.mode == "auto" else None,
        )
        return StructuredOutput(tool_calls=grammar, param="tools")


def read_answer(constraint: StructuredOutput, text: str, complete: bool, id_prefix: str) -> ParsedOutput:
    """The calls and text of a finished tool-mode answer (`complete`: not cut by a token limit or a stop
    sequence); each call gets a new id starting with `id_prefix`."""
    reader = tool_answer_reader(constraint)
    parts = [*reader.feed(text), *reader.finish(complete)]
    calls = tuple(
        ToolCall(new_call_id(id_prefix), p.name, json.dumps(json.loads(p.arguments), ensure_ascii=False))
        for p in parts
        if isinstance(p, CallPart)
    )
    content = "".join(p.text for p in parts if isinstance(p, TextPart))
    return ParsedOutput(calls, (content.strip(" \n;") or None) if calls else content)


def tool_answer_reader(constraint: StructuredOutput) -> AnswerReader:
    """A reader of answers under a tool-mode request's constraint."""
    assert constraint.tool_calls is not None, "a tool-mode request's constraint is its tool calls"
    return tool_reader(constraint.tool_calls)
