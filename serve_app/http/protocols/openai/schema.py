"""OpenAI's request bodies: chat completions and legacy completions, their sampling, structured-output and tool
fields, and the fields refused by name."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from serve_app.http.protocols.errors import invalid
from serve_app.http.protocols.fields import RequestModel, from_validation_error, text_only
from serve_app.http.protocols.reasoning import Effort
from serve_app.http.tools.plan import Prompt, ToolCall, ToolCallFormat, ToolPlan, ToolSpec, Turn, plan
from serve_app.wire.requests import CachePrefix, SamplingParams, StructuredOutput

CacheRetention = Literal["in_memory", "24h"]
# OpenAI's `prompt_cache_retention`: in memory, a prefix lasts "5 to 10 minutes of inactivity"; extended, 24 hours.
RETENTION_S = {"in_memory": 600.0, "24h": 24 * 3600.0}


def retained(retention: CacheRetention | None) -> CachePrefix | None:
    """The whole prompt kept cached as long as `prompt_cache_retention` says (nothing kept where it is unset)."""
    return CachePrefix(ttl_s=RETENTION_S[retention]) if retention is not None else None


# logit_bias entries at most (OpenAI's API takes up to 300; a client may bias a few thousand tokens at once).
MAX_LOGIT_BIAS = 4096

class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class RefusalPart(RequestModel):
    """An earlier assistant turn's refusal, sent back as its content."""

    type: Literal["refusal"]
    refusal: str


class FunctionCall(RequestModel):
    name: str
    arguments: str
    parsed_arguments: Any = Field(
        None, description="the OpenAI SDK's parsed copy of `arguments`, which its stream helpers send back; "
        "`arguments` is the call",
    )


class AssistantToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = Field(None, description="its place in a streamed answer, which the SDK's stream helpers keep")


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | RefusalPart] | None = None
    name: str | None = Field(None, description="the participant's name, given to the chat template")
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = Field(None, description="an earlier assistant turn's refusal: its text")
    function_call: None = Field(None, description="deprecated by OpenAI: send tool_calls (null accepted)")
    audio: None = Field(None, description="an earlier audio answer: this server produces text (null accepted)")
    reasoning_content: str | None = Field(None, description="an earlier assistant turn's thinking, given to the template")
    reasoning: str | None = Field(None, description="the same as reasoning_content (vLLM's newer name)")

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return text_only(value, ("text", "refusal"))

    @model_validator(mode="after")
    def _fields_on_their_roles(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry them")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool_call_id: tool messages need one, and only they")
        if self.refusal is not None and self.role != "assistant":
            raise ValueError("refusal: only assistant messages carry one")
        if self.thinking() is not None and self.role != "assistant":
            raise ValueError("reasoning_content: only assistant messages carry it")
        return self

    def thinking(self) -> str | None:
        """An assistant turn's thinking, by either name."""
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if isinstance(part, TextPart) else part.refusal for part in self.content)


class StreamOptions(RequestModel):
    include_usage: bool = False
    include_obfuscation: Literal[False] | None = Field(
        None, description="OpenAI's padding of streamed deltas: not added here (false or null accepted)"
    )


# Fields of OpenAI's and vLLM's APIs that this server does not implement: a 400 naming them (a value in `ACCEPTED`,
# the field's meaning when unset, is accepted).
UNSUPPORTED = {
    "functions": "deprecated by OpenAI and not supported: send tools",
    "function_call": "deprecated by OpenAI and not supported: send tool_choice",
    "prediction": "not supported",
    "audio": "not supported: this server produces text",
    "modalities": "only [\"text\"]: this server produces text",
    "web_search_options": "not supported",
    "store": "not supported: chat completions are not stored (the Responses API stores responses)",
    "service_tier": "only auto or default: there is one tier",
    "verbosity": "not supported",
    "guided_json": "not supported; send structured_outputs: {\"json\": ...}",
    "guided_regex": "not supported; send structured_outputs: {\"regex\": ...}",
    "guided_choice": "not supported; send structured_outputs: {\"choice\": ...}",
    "guided_grammar": "not supported; send structured_outputs: {\"grammar\": ...}",
    "guided_decoding_backend": "not supported: the backend is xgrammar",
    "guided_whitespace_pattern": "not supported",
    "best_of": "not supported: send n",
    "use_beam_search": "not supported: there is no beam search",
    "length_penalty": "not supported: there is no beam search",
    "truncate_prompt_tokens": "not supported",
    "prompt_logprobs": "not supported",
    "bad_words": "not supported: send logit_bias",
    "logits_processors": "not supported",
    "return_tokens_as_token_ids": "not supported",
    "spaces_between_special_tokens": "only true",
    "kv_transfer_params": "not supported: use the KV routes",
    "vllm_xargs": "not supported",
    "mm_processor_kwargs": "not supported: this model takes text only",
    "chat_template": "not supported: the model's own template is used",
    "documents": "not supported",
    "add_generation_prompt": "only true",
    "continue_final_message": "only false",
    "add_special_tokens": "only false for chat (the template holds the special tokens)",
    "echo": "only false for chat",
    "return_token_ids": "only on /v1/completions",
}
ACCEPTED: dict[str, tuple[Any, ...]] = {
    "modalities": (["text"],), "store": (False,), "service_tier": ("auto", "default"), "best_of": (1,),
    "use_beam_search": (False,), "length_penalty": (1.0,), "return_tokens_as_token_ids": (False,),
    "spaces_between_special_tokens": (True,), "add_generation_prompt": (True,), "continue_final_message": (False,),
    "add_special_tokens": (False,), "echo": (False,), "return_token_ids": (False,),
}
# Legacy completions: what the chat route refuses, less what they do have, and the chat-only fields.
COMPLETIONS_UNSUPPORTED = {
    **{name: reason for name, reason in UNSUPPORTED.items() if name not in ("echo", "return_token_ids")},
    "response_format": "legacy completions take structured_outputs",
    "add_special_tokens": "only true for completions (the prompt is encoded with the tokenizer's special tokens)",
}
COMPLETIONS_ACCEPTED = {**ACCEPTED, "add_special_tokens": (True,)}


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs` (extra body): exactly one of a JSON schema, any JSON object, a regex,
    a choice of strings, or an EBNF grammar."""

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


class JSONSchemaFormat(RequestModel):
    name: str
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

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


class SamplingFields(RequestModel):
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
    user: str | None = Field(None, max_length=256, description="the end user, recorded on the request's trace span")
    structured_outputs: StructuredOutputs | None = None
    max_string_tokens: int | None = Field(None, ge=1)
    logit_bias: dict[int, float] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id -> a bias in [-100, 100] added to its logit"
    )
    allowed_token_ids: list[int] | None = Field(None, min_length=1, description="only these tokens may be sampled")
    min_tokens: int = Field(0, ge=0, description="no EOS or stop token id, and no stop string, before this many tokens")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1, description="lower runs first, under scheduling_policy: priority")
    request_id: str | None = Field(None, min_length=1, max_length=128, description="the answer's id (after its prefix)")

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, bias: dict[int, float] | None) -> dict[int, float] | None:
        for token, value in (bias or {}).items():
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"the bias of token {token} is {value}, outside [-100, 100]")
        return bias

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
            logit_bias=self.logit_bias or None,
            allowed_token_ids=self.allowed_token_ids,
        )
        return dict(
            max_tokens=max_tokens,
            sampling=sampling,
            stop=stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            client_salt=self.cache_salt,
            logprobs=logprobs,
            structured_output=constraint,
            max_string_tokens=self.max_string_tokens,
            lora=lora,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            priority=self.priority,
        )


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
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
    safety_identifier: str | None = Field(None, max_length=256, description="recorded on the request's trace span")
    prompt_cache_key: str | None = Field(None, max_length=1024, description="the prompt's cache salt: cache_salt")
    prompt_cache_retention: CacheRetention | None = Field(None, description="keep the prompt cached this long")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, max_length=64, description="the chat template's further variables (`enable_thinking`, ...)"
    )
    reasoning_effort: Effort | None = Field(None, description="how long a reasoning model thinks (a thinking budget)")
    include_reasoning: bool = Field(True, description="vLLM's: false leaves the thinking out of the answer")
    thinking_token_budget: int | None = Field(None, ge=0, description="vLLM's: the thinking is closed after this many tokens")

    @model_validator(mode="after")
    def _one_salt(self) -> ChatCompletionRequest:
        if self.prompt_cache_key is not None:
            if self.cache_salt is not None and self.cache_salt != self.prompt_cache_key:
                raise ValueError("prompt_cache_key: it is the cache salt; give it or cache_salt, or both equal")
            self.cache_salt = self.prompt_cache_key
        return self

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
        return chat_prompt(self.messages, tools, tool_plan)


def chat_prompt(messages: list[ChatMessage], tools: ToolCallFormat, tool_plan: ToolPlan | None) -> Prompt:
    """Chat messages as the chat template takes them, in the model's tool-call format."""
    turns = []
    for m in messages:
        if m.role == "tool":
            turns.append(Turn("tool", m.text(), call_id=m.tool_call_id))
        elif m.tool_calls:
            calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls)
            turns.append(Turn("assistant", m.text(), calls=calls, author=m.name, reasoning=m.thinking()))
        else:
            role = "system" if m.role == "developer" else m.role
            turns.append(Turn(role, m.text(), author=m.name, reasoning=m.thinking()))
    return tools.prompt(turns, tool_plan)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    return_token_ids: bool = Field(False, description="also return the generated token ids (with each streamed chunk)")


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]], param: str) -> list[str | list[int]]:
    """A prompt field (legacy completions' `prompt`, embeddings' `input`) as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise invalid(f"{param}: must not be empty", param)
    return prompts
