"""Anthropic's request bodies: messages and their content blocks, tools and tool choice, output format, token
counting, and the fields refused by name."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from serve_app.http.protocols.errors import invalid
from serve_app.http.protocols.fields import RequestModel, UnknownFields, refuse_fields, text_only, validate_body
from serve_app.http.protocols.reasoning import Thinking, reasoning_model
from serve_app.http.served_models import adapter_of
from serve_app.http.tools.plan import Prompt, ToolCall, ToolCallFormat, ToolPlan, ToolSpec, Turn, plan
from serve_app.wire.model_card import ModelInfo
from serve_app.wire.requests import CachePrefix, StructuredOutput


class CacheControl(RequestModel):
    """A prompt-caching breakpoint: the prompt up to here is kept cached (5 minutes unless `ttl` says 1 hour)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None

    @property
    def ttl_s(self) -> float:
        return 3600.0 if self.ttl == "1h" else 300.0


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = Field(None, description="citations of documents: this model takes text only (null accepted)")


class Caller(RequestModel):
    """Who made a tool call: the model itself (the only caller here; no code execution tool runs)."""

    type: Literal["direct"]


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: Caller | None = None
    toolset_name: None = Field(None, description="a server toolset's member: none run here (null only)")


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None
    toolset_name: None = Field(None, description="a server toolset's member: none run here (null only)")

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return text_only(value, ("text",))

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"(error) {text}" if self.is_error else text


def thinking_signature(thinking: str) -> str:
    """A thinking block's signature: the digest of its text, checked when a conversation sends the block back (it
    shows the text unchanged, not who wrote it)."""
    return hashlib.sha256(thinking.encode()).hexdigest()


class ThinkingBlock(RequestModel):
    """An earlier assistant turn's thinking, sent back with its signature; the template gets it as reasoning_content."""

    type: Literal["thinking"]
    thinking: str
    signature: str

    @model_validator(mode="after")
    def _signed(self) -> ThinkingBlock:
        if self.signature != thinking_signature(self.thinking):
            raise ValueError("signature: it does not match the block's thinking (send the block back as it came)")
        return self


def _block_kind(block: Any) -> str | None:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return {
        "text": "TextBlock", "tool_use": "ToolUseBlock", "tool_result": "ToolResultBlock", "thinking": "ThinkingBlock"
    }.get(kind)


# Blocks tagged by class name, so that an error's field path leaves the tag out.
Block = Annotated[
    Annotated[TextBlock, Tag("TextBlock")] | Annotated[ToolUseBlock, Tag("ToolUseBlock")]
    | Annotated[ToolResultBlock, Tag("ToolResultBlock")] | Annotated[ThinkingBlock, Tag("ThinkingBlock")],
    Discriminator(_block_kind),
]


class Message(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        return text_only(value, ("text", "tool_use", "tool_result", "thinking"))

    def blocks(self) -> list[Block]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class Tool(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str = ""
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = Field(None, description="inputs always match input_schema here (its grammar is enforced)")
    allowed_callers: list[Literal["direct"]] | None = Field(None, description="only the model calls tools here")
    defer_loading: Literal[False] | None = Field(None, description="every tool is in the prompt (no tool search)")
    eager_input_streaming: Literal[False] | None = Field(
        None, description="a call's input streams in one piece once whole (false or null only)"
    )
    input_examples: None = Field(None, description="not supported (null only)")


class Metadata(RequestModel):
    user_id: str | None = Field(None, max_length=256, description="the end user, recorded on the request's trace span")


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name: give it exactly when type is tool")
        return self


class ThinkingEnabled(RequestModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024, description="thinking tokens at most: the span is closed there")


class ThinkingDisabled(RequestModel):
    type: Literal["disabled"]


class ThinkingAdaptive(RequestModel):
    type: Literal["adaptive"]


# Anthropic's efforts as thinking budgets (max: up to the output's own limit).
EFFORT_BUDGET: dict[str, int | None] = {"low": 1024, "medium": 4096, "high": None, "max": None}


class CountTokensRequest(RequestModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = Field(None, description="a breakpoint at the last cacheable block")
    speed: Literal["standard"] | None = Field(None, description="one speed here: standard")
    thinking: ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | None = Field(
        None, discriminator="type", description="extended thinking (a model with a reasoning_parser); unset: none"
    )

    def thinking_budget(self, model: ModelInfo, effort: str | None = None) -> Thinking:
        """What `thinking` (and adaptive thinking's `effort`, `output_config.effort`) asks: no thinking unless it is
        enabled."""
        if effort is not None and not isinstance(self.thinking, ThinkingAdaptive):
            raise invalid("output_config.effort: it sets adaptive thinking's effort (thinking: {type: adaptive})", "output_config.effort")
        match self.thinking:
            case ThinkingEnabled(budget_tokens=budget):
                reasoning_model(model, "thinking")
                return Thinking(budget)
            case ThinkingAdaptive():
                reasoning_model(model, "thinking")
                return Thinking(EFFORT_BUDGET[effort or "high"])
        return Thinking(0) if model.reasoning_parser is not None else Thinking()

    def tool_plan(self) -> ToolPlan | None:
        """How this request may call its tools, and which (Anthropic's `any` is `required`, `tool` a named one)."""
        specs = [ToolSpec(t.name, t.description, t.input_schema) for t in self.tools or []]
        if self.tool_choice is None:
            return plan(specs, None)
        kind = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[self.tool_choice.type]
        return plan(specs, kind, self.tool_choice.name, parallel=not self.tool_choice.disable_parallel_tool_use)

    def cache_prefix(self, tools: ToolCallFormat, tool_plan: ToolPlan | None) -> CachePrefix | None:
        """Anthropic's prompt caching: the prompt up to its last breakpoint, kept for the longest TTL its breakpoints
        ask. A block's breakpoint keeps the whole of its message; one on a tool or the system keeps the system
        (the first message where there is no system); the top-level `cache_control` keeps the whole prompt."""
        marks = [(len(self.messages), self.cache_control)] if self.cache_control is not None else []
        marks += [(0, tool.cache_control) for tool in self.tools or [] if tool.cache_control is not None]
        if isinstance(self.system, list):
            marks += [(0, block.cache_control) for block in self.system if block.cache_control is not None]
        for index, message in enumerate(self.messages):
            if not isinstance(message.content, str):
                marks += [(index + 1, b.cache_control) for b in message.content if getattr(b, "cache_control", None)]
        if not marks:
            return None
        ttl_s = max(control.ttl_s for _, control in marks)
        kept = max(count for count, _ in marks) or (0 if self.system else 1)
        if kept >= len(self.messages):
            return CachePrefix(ttl_s=ttl_s)
        head = self.model_copy(update={"messages": self.messages[:kept]})
        return CachePrefix(ttl_s=ttl_s, messages=head.prompt(tools, tool_plan).messages)

    def prompt(self, tools: ToolCallFormat, tool_plan: ToolPlan | None) -> Prompt:
        """System and turns for the chat template, in the model's tool-call format: a message's tool
        results are tool turns (before its text), its tool uses the assistant turn's calls."""
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        turns = [Turn("system", system)] if system else []
        for message in self.messages:
            blocks = message.blocks()
            text = "\n".join(b.text for b in blocks if isinstance(b, TextBlock))
            turns.extend(
                Turn("tool", b.text(), call_id=b.tool_use_id) for b in blocks if isinstance(b, ToolResultBlock)
            )
            uses = tuple(
                ToolCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False))
                for b in blocks if isinstance(b, ToolUseBlock)
            )
            thoughts = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
            reasoning = "\n".join(thoughts) if thoughts else None
            if uses or text or reasoning is not None or not any(isinstance(b, ToolResultBlock) for b in blocks):
                turns.append(Turn(message.role, text, calls=uses, reasoning=reasoning))
        return tools.prompt(turns, tool_plan)


class OutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    """Anthropic's `output_config`: its `format` (structured output) is enforced; `effort` sets adaptive thinking's
    budget."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "max"] | None = Field(None, description="how long adaptive thinking runs")


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="there is one tier: both mean it")
    output_config: OutputConfig | None = None
    max_string_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _budget_within_max_tokens(self) -> MessagesRequest:
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens: it must be less than max_tokens")
        return self

    def output_constraint(self, tools: ToolCallFormat, tool_plan: ToolPlan | None) -> StructuredOutput | None:
        """The grammar of the answer: the tool-call format's (`output_config.format` holding an answer
        that uses no tool), or `output_config.format`'s."""
        schema = self.output_config.format.schema_ if self.output_config and self.output_config.format else None
        if tool_plan is not None:
            return tools.constraint(tool_plan, schema)
        return StructuredOutput(json=schema, param="output_config.format.schema") if schema is not None else None


# Fields of Anthropic's API that this server does not implement: a 400 naming them.
UNSUPPORTED = {
    "mcp_servers": "not supported",
    "container": "not supported",
    "context_management": "not supported",
    "output_format": "send output_config.format",
    "diagnostics": "not supported",
    "inference_geo": "not supported: the server runs where it is deployed",
}


def parse(model: type[RequestModel], body: Any, served: ModelInfo, unknown: UnknownFields = "reject") -> Any:
    """Validate a body and its `model` (an unknown model is a 404, as Anthropic's API answers)."""
    req = validate_body(model, refuse_fields(body, UNSUPPORTED), unknown)
    adapter_of(served, req.model)  # an unknown model is a 404, as Anthropic's API answers
    return req
