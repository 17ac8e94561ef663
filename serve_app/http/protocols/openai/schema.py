"""OpenAI's request bodies: chat completions and legacy completions, their sampling, structured-output and tool
fields, and the fields refused by name."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from serve_app.engine.io import SamplingParams, StructuredOutput
from serve_app.http.protocols.errors import from_validation_error, invalid
from serve_app.http.tools.plan import Prompt, ToolCall, ToolCallFormat, ToolPlan, ToolSpec, Turn, plan


class _Lenient(BaseModel):
    # Fields that SDKs send and this server does not use are ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    name: str
    arguments: str


class AssistantToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields_on_their_roles(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry them")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool_call_id: tool messages need one, and only they")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Lenient):
    include_usage: bool = False


# Fields of OpenAI's (and vLLM's) APIs that this server does not implement: a 400 naming them.
UNSUPPORTED = {
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "logit_bias": "not supported",
    "prediction": "not supported",
    "audio": "not supported: this server produces text",
    "web_search_options": "not supported",
    "guided_json": "not supported; send structured_outputs: {\"json\": ...}",
    "guided_regex": "not supported; send structured_outputs: {\"regex\": ...}",
    "guided_choice": "not supported; send structured_outputs: {\"choice\": ...}",
    "guided_grammar": "not supported; send structured_outputs: {\"grammar\": ...}",
}


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (extra body): exactly one of a JSON schema, any JSON object, a regex,
    a choice of strings, or an EBNF grammar."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def to_engine(self) -> StructuredOutput:
        schema = self.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise invalid(f"structured_outputs.json: not a JSON schema ({error.msg})", "structured_outputs.json") from None
        fields = {"json": schema, "json_object": bool(self.json_object), "regex": self.regex, "choice": self.choice,
                  "grammar": self.grammar}
        return _structured(param="structured_outputs", **fields)


class JSONSchemaFormat(_Lenient):
    name: str
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: give it exactly when type is json_schema")
        return self

    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema an answer in this format matches (None: free text)."""
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema.schema_ if self.json_schema is not None else None

    def to_engine(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return _structured(param="response_format", json_object=True)
        if self.type == "json_schema" and self.json_schema is not None:
            return _structured(param="response_format.json_schema.schema", json=self.json_schema.schema_)
        return None


def _structured(**fields: Any) -> StructuredOutput:
    try:
        return StructuredOutput(**fields)
    except ValidationError as error:
        raise from_validation_error(error, prefix=f"{fields['param']}.") from None


class SamplingFields(_Lenient):
    """The sampling and stop fields both OpenAI routes share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    n: int = Field(1, ge=1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    user: str | None = None
    structured_outputs: StructuredOutputs | None = None
    max_string_tokens: int | None = Field(None, ge=1)

    def structured_output(self) -> StructuredOutput | None:
        return self.structured_outputs.to_engine() if self.structured_outputs is not None else None

    def engine_fields(
        self, max_tokens: int | None, logprobs: int | None, choice: int, constraint: StructuredOutput | None,
        lora: str | None = None,
    ) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        sampling = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            # Choices of one request differ: each draws from its own seed.
            seed=None if self.seed is None else self.seed + choice,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
        )
        return dict(
            max_tokens=max_tokens,
            sampling=sampling,
            stop=stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            cache_salt=self.cache_salt,
            logprobs=logprobs,
            structured_output=constraint,
            max_string_tokens=self.max_string_tokens,
            lora=lora,
        )


class FunctionDefinition(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ChatTool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def tool_plan(self) -> ToolPlan | None:
        """How this request may call its tools, and which."""
        specs = [ToolSpec(t.function.name, t.function.description, t.function.parameters) for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice):
            return plan(specs, "named", self.tool_choice.function.name)
        return plan(specs, self.tool_choice, parallel=self.parallel_tool_calls)

    def output_constraint(self, tools: ToolCallFormat, tool_plan: ToolPlan | None) -> StructuredOutput | None:
        """The grammar of the answer: the tool-call format's (a response_format holding an answer that calls
        nothing), a response_format's, or structured_outputs'."""
        from_format = self.response_format.to_engine() if self.response_format is not None else None
        if from_format is not None and self.structured_outputs is not None:
            raise invalid("structured_outputs: give it or a response_format other than text, not both", "structured_outputs")
        if tool_plan is not None:
            if self.structured_outputs is not None:
                raise invalid("structured_outputs: give tools a response_format instead", "structured_outputs")
            answer = self.response_format.answer_schema() if self.response_format is not None else None
            return tools.constraint(tool_plan, answer)
        return from_format or self.structured_output()

    def prompt(self, tools: ToolCallFormat, tool_plan: ToolPlan | None) -> Prompt:
        """The conversation for the chat template, in the model's tool-call format."""
        turns = []
        for m in self.messages:
            if m.role == "tool":
                turns.append(Turn("tool", m.text(), call_id=m.tool_call_id))
            elif m.tool_calls:
                calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls)
                turns.append(Turn("assistant", m.text(), calls=calls))
            else:
                turns.append(Turn("system" if m.role == "developer" else m.role, m.text()))
        return tools.prompt(turns, tool_plan)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    return_token_ids: bool = Field(False, description="also return the generated token ids (with each streamed chunk)")
