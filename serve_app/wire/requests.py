"""What a request asks of an engine: its prompt or messages, sampling, structured output (a grammar or tool
calls), stop rules, prompt-caching breakpoint, and the request as an engine runs it (token ids and salts)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.wire.model_card import ToolFormat


class SamplingParams(BaseModel):
    """How one request picks its tokens. `temperature=0` is greedy; `top_k` 0 or -1 disables top-k."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0)
    top_k: int = Field(50, ge=-1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1, description="what torch.Generator takes")
    logit_bias: dict[int, float] | None = Field(None, description="token id -> a bias added to its logit, greedy or not")
    allowed_token_ids: list[int] | None = Field(None, min_length=1, description="only these tokens may be chosen")

    @field_validator("logit_bias")
    @classmethod
    def _finite_bias(cls, bias: dict[int, float] | None) -> dict[int, float] | None:
        if bias is not None and not all(-1e4 <= value <= 1e4 for value in bias.values()):
            raise ValueError("logit_bias: each bias within [-1e4, 1e4]")
        return bias

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_bias(self) -> bool:
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_calls")


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    parameters: dict[str, Any]


class ToolCallGrammar(BaseModel):
    """Tool calls in a tool-call format (the generic JSON one, or a chat template's own), each call's
    arguments matching its tool's schema: `auto` lets the answer be text (or, with `answer_schema`, JSON
    matching it) or calls (in a template's format, after any text); `required` is calls only; `named` is
    one call of the only tool given; `parallel` false ends the output after one call."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: ToolFormat
    tools: list[FunctionTool] = Field(min_length=1)
    mode: Literal["auto", "required", "named"]
    parallel: bool = True
    answer_schema: dict[str, Any] | None = Field(
        None, description="what an answer that calls nothing must match (a JSON schema), `auto` only"
    )

    @model_validator(mode="after")
    def _answer_schema_with_auto(self) -> ToolCallGrammar:
        if self.answer_schema is not None and self.mode != "auto":
            raise ValueError("answer_schema: only an `auto` answer may be other than calls")
        return self


class StructuredOutput(BaseModel):
    """Exactly one constraint. `param` names the client's field it came from, for error messages."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    json_schema: dict[str, Any] | None = Field(None, alias="json")
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    tool_calls: ToolCallGrammar | None = None
    param: str = "structured_output"

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutput:
        given = [name for name, value in self._constraints().items() if value not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}")
        if self.choice is not None and (not self.choice or any(not c for c in self.choice)):
            raise ValueError("choice: give at least one non-empty string")
        return self

    def _constraints(self) -> dict[str, Any]:
        return {
            "json": self.json_schema,
            "json_object": self.json_object,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "tool_calls": self.tool_calls.model_dump() if self.tool_calls is not None else None,
        }

    @property
    def kind(self) -> str:
        return next(name for name, value in self._constraints().items() if value not in (None, False))

    @property
    def is_json(self) -> bool:
        """Whether the answer is JSON or tool calls (what `max_string_tokens` and `max_constrained_tokens` bound)."""
        return self.kind in ("json", "json_object", "tool_calls")

    @property
    def key(self) -> str:
        """A canonical text of the constraint: equal constraints compile once."""
        return json.dumps({self.kind: self._constraints()[self.kind]}, sort_keys=True, separators=(",", ":"))


# What the server gives a chat template itself; `chat_template_kwargs` may not set them.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize", "chat_template",
    "return_dict", "return_assistant_tokens_mask", "padding", "truncation", "max_length", "return_tensors",
    "tokenizer_kwargs",
})

# The longest a prompt-caching breakpoint keeps its prefix (OpenAI's `prompt_cache_retention: 24h`).
MAX_CACHE_TTL_S = 24 * 3600.0


class CachePrefix(BaseModel):
    """A prompt-caching breakpoint: keep the prompt's prefix cached for `ttl_s` (pinned in the page pool, or in a
    KV tier when the pool is short). The prefix is the whole prompt, or the conversation `messages` (up to the
    breakpoint, rendered as the prompt's are, tools included) where given."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttl_s: float = Field(gt=0, le=MAX_CACHE_TTL_S)
    messages: list[dict[str, Any]] | None = None


class GenerateRequest(BaseModel):
    """One generation: a prompt (text or token ids) or chat messages, sampling and stop settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(
        None, description="function tools (OpenAI's shape) for a chat template that takes them; with messages only"
    )
    max_tokens: int | None = Field(16, ge=1, description="None: up to the end of the model's context")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    client_salt: str | None = Field(
        None, description="the salt its prompt's pages are cached under, as the client asked (None: none asked; the "
        "APIs' `cache_salt`): a server derives the tenant's salt from it and the caller's tenant "
        "(`EncodedRequest.tenant_salt`); in process it is the tenant salt as it is",
    )
    lora: str | None = Field(None, description="the LoRA adapter to run with (named in lora_paths, or a folder under dynamic_lora_loading_path)")
    logprobs: int | None = Field(None, ge=0, le=20, description="also return each token's logprob and this many top ones")
    structured_output: StructuredOutput | None = Field(None, description="what the output must match, enforced per token")
    max_string_tokens: int | None = Field(
        None, ge=1,
        description="a JSON string of the answer is closed after this many tokens, where its grammar lets it end "
        "(a JSON or tool-call answer only)",
    )
    max_constrained_tokens: int | None = Field(
        None, ge=1,
        description="the answer ends (length) after this many tokens inside its constrained JSON: its calls, "
        "or the whole of a JSON answer (a JSON or tool-call answer only)",
    )
    min_tokens: int = Field(0, ge=0, description="no EOS or stop token id can be chosen, nor a stop string end it, before this many tokens")
    include_stop_str_in_output: bool = Field(False, description="a stop string that ends the output is part of its text")
    skip_special_tokens: bool = Field(True, description="special tokens are left out of the text")
    priority: int = Field(0, description="lower runs first, where the engine's scheduling_policy is priority")
    suffix: str | None = Field(
        None, description="the text after the insertion (fill in the middle between prompt and suffix); a text prompt only"
    )
    cache_prefix: CachePrefix | None = Field(None, description="keep the prompt's prefix cached for a while")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="the chat template's further variables (`enable_thinking`, ...); with messages only"
    )
    embed: bool = Field(
        False, description="return the prompt's embedding (its last token's final hidden state, L2-normalized, as vLLM "
        "pools a decoder model) instead of generating; a prompt only",
    )
    thinking_token_budget: int | None = Field(
        None, ge=0,
        description="a reasoning model's thinking is closed after this many tokens (its engine's reasoning_parser "
        "reads the span); None: the output's own limit",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_VARIABLES)
        if reserved:
            raise ValueError(f"chat_template_kwargs: {reserved[0]!r} is the server's to set")
        return kwargs

    @model_validator(mode="before")
    @classmethod
    def _flat_sampling_fields(cls, data: Any) -> Any:
        """`GenerateRequest(prompt=..., temperature=0)`: sampling fields given flat go into `sampling`."""
        if not isinstance(data, dict):
            return data
        flat = {key: data[key] for key in SamplingParams.model_fields if key in data}
        if not flat:
            return data
        if "sampling" in data:
            raise ValueError(f"give the sampling fields in `sampling` or flat, not both ({', '.join(flat)})")
        rest = {key: value for key, value in data.items() if key not in flat}
        return {**rest, "sampling": flat}

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else ([] if value is None else value)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: str | list[int] | None) -> str | list[int] | None:
        if value is not None and len(value) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and any(token < 0 for token in value):
            raise ValueError("prompt token ids must be >= 0")
        return value

    @field_validator("messages")
    @classmethod
    def _messages_not_empty(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value is not None:
            if not value:
                raise ValueError("messages must not be empty")
            for index, message in enumerate(value):
                if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                    raise ValueError(f"messages[{index}] needs a string 'role' and a string 'content'")
        return value

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt or messages: give exactly one")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools: give them with messages")
        if self.suffix is not None and not isinstance(self.prompt, str):
            raise ValueError("suffix: give it with a text prompt")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} is over max_tokens={self.max_tokens}")
        if self.chat_template_kwargs is not None and self.messages is None:
            raise ValueError("chat_template_kwargs: give them with messages")
        if self.cache_prefix is not None and self.cache_prefix.messages is not None and self.messages is None:
            raise ValueError("cache_prefix: its messages go with chat messages")
        if self.min_tokens and self.structured_output is not None:
            raise ValueError("min_tokens: not with a structured output (its grammar decides where the answer ends)")
        return self


def token_id_outside(request: GenerateRequest, prompt_ids: Sequence[int], vocab_size: int) -> tuple[str, str] | None:
    """The field and the message that name the first of a request's token ids (its prompt's, given as `prompt_ids`,
    its stop ids, its `logit_bias` and `allowed_token_ids`) outside the vocabulary; None where all are inside."""
    sampling = request.sampling
    named_ids = (
        ("prompt", prompt_ids), ("stop_token_ids", request.stop_token_ids),
        ("logit_bias", list(sampling.logit_bias or ())), ("allowed_token_ids", sampling.allowed_token_ids or ()),
    )
    for field_name, ids in named_ids:
        if ids:
            low, high = min(ids), max(ids)
            if low < 0 or high >= vocab_size:
                bad = low if low < 0 else high
                return field_name, f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})"
    return None


@dataclass(frozen=True)
class EncodedRequest:
    """What an engine runs: the request as asked, its prompt as token ids (the chat template rendered, once,
    before routing), the tenant's salt (a server's, derived from the caller's tenant and the client's salt; in
    process, the client's), and the trace context (W3C `traceparent`) of the span that sent it, where tracing is on."""

    request: GenerateRequest
    prompt_ids: list[int]
    tenant_salt: str = ""
    trace_context: dict[str, str] = field(default_factory=dict)
    pin_tokens: int = 0  # the leading prompt tokens its `cache_prefix` keeps cached
    background: bool = False  # a batch's (the Batch API's): it runs in what online requests leave over

    @property
    def prefix_salt(self) -> str:
        """The salt its prompt's pages are cached under: KV made under one adapter is never another's (or
        the base model's), so the adapter is part of it. The engine and the request router both use it."""
        lora = self.request.lora
        return self.tenant_salt if lora is None else f"{self.tenant_salt}\x00lora:{lora}"
