"""The Responses API's request body: input items, instructions, function tools, `text.format`, and the fields
refused by name."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from serve_app.http.protocols.errors import invalid
from serve_app.http.protocols.fields import RequestModel, text_only, validate_part
from serve_app.http.protocols.openai.schema import CacheRetention
from serve_app.http.protocols.reasoning import Effort
from serve_app.http.tools.plan import ToolCall, ToolCallFormat, ToolPlan, ToolSpec, Turn, call_names, plan
from serve_app.wire.requests import StructuredOutput


class InputText(RequestModel):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text parts echoed back from an earlier output
    logprobs: list[Any] | None = None


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return text_only(value, ("input_text", "output_text"))

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningText(RequestModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(RequestModel):
    """An earlier response's thinking, sent back as input: the template gets it with the assistant turn it precedes."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list, description="summaries are not written here: sent back as they came")
    content: list[ReasoningText] | None = None
    encrypted_content: None = Field(None, description="not written here (null only)")
    status: str | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


class ReasoningOptions(RequestModel):
    effort: Effort | None = Field(None, description="how long a reasoning model thinks (a thinking budget)")
    summary: None = Field(None, description="reasoning summaries: not written here (the item carries the thinking)")
    generate_summary: None = Field(None, description="deprecated by OpenAI: summaries are not written here")


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


def _item_kind(item: Any) -> str:
    return item.get("type", "message") if isinstance(item, dict) else "message"


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("schema: give it exactly when type is json_schema")
        return self


class TextOptions(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(None, description="the model's own length: only medium")


# Fields of the Responses API that this server does not implement: a 400 naming them.
UNSUPPORTED = {
    "background": "not supported: responses run in the foreground",
    "conversation": "not supported; continue with previous_response_id",
    "prompt": "not supported: there are no stored prompt templates here",
    "top_logprobs": "not supported",
    "max_tool_calls": "not supported",
    "service_tier": "not supported",
    "context_management": "not supported",
    "prompt_cache_options": "not supported",
    "stream_options": "only include_obfuscation: false (deltas are not padded here)",
}
ACCEPTED: dict[str, tuple[Any, ...]] = {"stream_options": ({"include_obfuscation": False},), "service_tier": ("auto", "default")}


class ResponsesRequest(RequestModel):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = Field(None, max_length=1024, description="the prompt's cache salt")
    prompt_cache_retention: CacheRetention | None = Field(None, description="keep the prompt cached this long")
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    max_string_tokens: int | None = Field(None, ge=1)
    reasoning: ReasoningOptions | None = None
    _items: list[InputItem] = PrivateAttr(default_factory=list)
    _function_tools: list[FunctionTool] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _parts(self, info: ValidationInfo) -> ResponsesRequest:
        """The input items and tools, each validated as its type says (errors named from the body's root)."""
        unknown = (info.context or {}).get("unknown_fields", "reject")
        if isinstance(self.input, str):
            self._items = [MessageItem(role="user", content=self.input)]
        else:
            kinds = {
                "message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
                "reasoning": ReasoningItem,
            }
            for index, item in enumerate(self.input):
                kind = kinds.get(_item_kind(item))
                if kind is None:
                    raise invalid(f"input.{index}.type: {_item_kind(item)!r} items are not supported", f"input.{index}.type")
                self._items.append(validate_part(kind, item, f"input.{index}.", unknown))
        for index, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise invalid(
                    f"tools.{index}.type: {tool.get('type')!r} tools are not supported; only function tools",
                    f"tools.{index}.type",
                )
            self._function_tools.append(validate_part(FunctionTool, tool, f"tools.{index}.", unknown))
        return self

    @field_validator("include")
    @classmethod
    def _nothing_to_include(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError("no additional output data is available from this server")
        return value

    def input_items(self) -> list[InputItem]:
        return self._items

    def function_tools(self) -> list[FunctionTool]:
        return self._function_tools

    def tool_plan(self) -> ToolPlan | None:
        specs = [
            ToolSpec(t.name, t.description or "", t.parameters or {"type": "object", "properties": {}})
            for t in self.function_tools()
        ]
        if isinstance(self.tool_choice, FunctionChoice):
            return plan(specs, "named", self.tool_choice.name)
        return plan(specs, self.tool_choice, parallel=self.parallel_tool_calls)

    def output_constraint(self, tools: ToolCallFormat, tool_plan: ToolPlan | None) -> StructuredOutput | None:
        """The grammar of the answer: the tool-call format's (`text.format` holding an answer that calls
        nothing), or `text.format`'s."""
        text_format = self.text.format if self.text is not None else None
        if tool_plan is not None:
            schema = None
            if text_format is not None and text_format.type != "text":
                schema = text_format.schema_ if text_format.type == "json_schema" else {"type": "object"}
            return tools.constraint(tool_plan, schema)
        if text_format is None or text_format.type == "text":
            return None
        if text_format.type == "json_object":
            return StructuredOutput(json_object=True, param="text.format")
        return StructuredOutput(json=text_format.schema_, param="text.format.schema")

    def turns(self, earlier: Sequence[Turn]) -> list[Turn]:
        """The conversation so far: an earlier response's, then this input (calls and a reasoning item join their
        assistant turn)."""
        turns = list(earlier)
        names = call_names(turns)
        fresh = len(turns)

        def open_assistant() -> Turn | None:
            """This input's last turn, where an assistant's reasoning, message or call may still join it."""
            last = turns[-1] if len(turns) > fresh else None
            return last if last is not None and last.role == "assistant" else None

        for item in self.input_items():
            last = open_assistant()
            if isinstance(item, ReasoningItem):
                turns.append(Turn("assistant", "", reasoning=item.text()))
            elif isinstance(item, MessageItem):
                if item.role == "assistant" and last is not None and not last.content and not last.calls:
                    turns[-1] = replace(last, content=item.text())
                else:
                    turns.append(Turn("system" if item.role == "developer" else item.role, item.text()))
            elif isinstance(item, FunctionCallItem):
                call = ToolCall(item.call_id, item.name, item.arguments)
                names[call.id] = call.name
                if last is not None:
                    turns[-1] = replace(last, calls=(*last.calls, call))
                else:
                    turns.append(Turn("assistant", "", calls=(call,)))
            else:
                turns.append(Turn("tool", item.text(), call_id=item.call_id, name=names.get(item.call_id)))
        return turns
