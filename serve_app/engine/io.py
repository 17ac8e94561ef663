"""Every type that crosses a boundary (HTTP layer to engine, host to engine process, ingress to replica over
Ray, KV SDK to server): the request with its sampling and structured-output parts, the deltas that come
back, the calls besides generating and their replies, a refusal, the model's card and the KV layout.
Plain pydantic and frozen dataclasses: importing this loads no torch and no Ray."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.config import GrammarConfig, ReasoningParser, ToolFormat

if TYPE_CHECKING:
    import torch

# The tiers a cached page can come from besides the engine's own pool.
TIER_NAMES = ("host", "disk", "cluster")
# The bounds of the tokens-per-step histogram an engine keeps (vLLM's `iteration_tokens_total`).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


# -- what a request asks for -------------------------------------------------------------------
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


FinishReason = Literal["stop", "length", "cancelled", "error"]

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
    cache_salt: str | None = Field(
        None, description="the salt its prompt's pages are cached under, as asked (None: none asked): a server "
        "derives the engine's own from it and the caller's tenant (`EncodedRequest.engine_salt`); in process it is "
        "used as it is",
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
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of the prompt, found in the prefix cache
    cache_written_tokens: int = 0  # of the prompt, not found there but kept there for its breakpoint's TTL
    reasoning_tokens: int = 0  # of the completion, the thinking's (its tags included)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model, and the most likely tokens at its position."""

    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True)
class StreamDelta:
    """New text and token ids for one request. The last delta has a finish reason and the usage."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    stop_string: str | None = None
    usage: Usage | None = None
    error: str | None = None
    queue_time_s: float | None = None  # on the first delta: how long the request waited to be admitted
    reasoning: str = ""  # new thinking text, apart from the answer's `text` (an engine with a reasoning_parser)
    embedding: tuple[float, ...] | None = None  # an `embed` request's (its only delta)


def merge_deltas(deltas: list[StreamDelta]) -> StreamDelta:
    """Several consecutive deltas as one (for a consumer that fell behind)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return replace(
        last,
        text="".join(d.text for d in deltas),
        reasoning="".join(d.reasoning for d in deltas),
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        logprobs=tuple(lp for d in deltas for lp in d.logprobs),
        usage=last.usage or next((d.usage for d in deltas if d.usage is not None), None),
        queue_time_s=next((d.queue_time_s for d in deltas if d.queue_time_s is not None), None),
    )


@dataclass(frozen=True)
class EncodedRequest:
    """What an engine runs: the request as asked, its prompt as token ids (the chat template rendered, once,
    before routing), the salt its pages are cached under, and the trace context (W3C `traceparent`) of the
    span that sent it, where tracing is on."""

    request: GenerateRequest
    prompt_ids: list[int]
    engine_salt: str = ""
    trace_context: dict[str, str] = field(default_factory=dict)
    pin_tokens: int = 0  # the leading prompt tokens its `cache_prefix` keeps cached

    @property
    def prefix_salt(self) -> str:
        """The salt its prompt's pages are cached under: KV made under one adapter is never another's (or
        the base model's), so the adapter is part of it. The engine and the request router both use it."""
        lora = self.request.lora
        return self.engine_salt if lora is None else f"{self.engine_salt}\x00lora:{lora}"


# -- refusals --------------------------------------------------------------------------------------
RefusalKind = Literal["invalid_request", "not_ready", "overloaded"]


class RequestRefused(Exception):
    """The engine would not take a request or a call. Raised where that is found (the engine's checks raise the
    kinds in `serve_app.errors`), it crosses the engine's process and Ray as it is (a Ray stream yields it as a
    value), and the HTTP side turns it into its protocol's error at one place (`ProtocolError.of`)."""

    kind: RefusalKind = "invalid_request"

    def __init__(self, message: str, param: str | None = None, kind: RefusalKind | None = None) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.message = message
        self.param = param
        if kind is not None:
            self.kind = kind

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # subclasses take other arguments: rebuild by fields
        return _rebuild_refusal, (type(self), self.message, self.param, self.kind)


def _rebuild_refusal(cls: type[RequestRefused], message: str, param: str | None, kind: RefusalKind) -> RequestRefused:
    refused = cls.__new__(cls)
    RequestRefused.__init__(refused, message, param, kind)
    return refused


# -- calls besides generating, and their replies ------------------------------------------------------
@dataclass(frozen=True)
class GetStats:
    """The engine's counters and queue lengths now."""


@dataclass(frozen=True)
class GetKVConfig:
    """What a KV tensor means: page size, geometry, dtype, RoPE (answers a `KVConfig`)."""


@dataclass(frozen=True)
class LookupKV:
    """How much of `tokens` is cached under `cache_salt`, and where (answers a `KVLookup`)."""

    tokens: list[int]
    cache_salt: str = ""


@dataclass(frozen=True)
class KVLookup:
    """`cached_tokens`: the leading tokens, in whole pages, in the engine's pool (what a retrieve returns);
    `pages`: the tier holding each leading page held anywhere ("pool", then "host", "disk" or "cluster")."""

    cached_tokens: int
    pages: tuple[str, ...]


@dataclass(frozen=True)
class RetrieveKV:
    """The KV of the longest cached whole-page prefix of `tokens` (None under one page)."""

    tokens: list[int]
    cache_salt: str = ""


@dataclass(frozen=True)
class StoreKV:
    """Cache `kv` as the KV of `tokens` under `cache_salt` (answers a `StoreResult`)."""

    kv: torch.Tensor
    tokens: list[int]
    cache_salt: str = ""


@dataclass(frozen=True)
class ListAdapters:
    """The LoRA adapters the engine can run with: its `lora_paths` and the adapter folders under its
    `dynamic_lora_loading_path`."""


EngineCall = GetStats | GetKVConfig | LookupKV | RetrieveKV | StoreKV | ListAdapters


@dataclass(frozen=True)
class KVConfig:
    """What a KV tensor means: its page size, geometry, dtype, and the model's rotary embedding.

    `rope_inv_freq` holds the rotary frequencies of each of the `rotary_dim / 2` pairs of a head
    (pairs are `(i, i + rotary_dim / 2)`, as in Hugging Face models), so K can be moved to other
    positions whatever the RoPE variant.
    """

    page_size: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    rope_type: str
    rope_theta: float | None
    rotary_dim: int
    rope_inv_freq: tuple[float, ...]

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "rope_inv_freq": list(self.rope_inv_freq)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> KVConfig:
        return cls(**{**data, "rope_inv_freq": tuple(data["rope_inv_freq"])})  # type: ignore[arg-type]

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # only where a tensor is made: the types here load no torch

        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class StoreResult:
    """How many pages a store wrote, and how many were already cached (and skipped)."""

    stored_pages: int
    deduplicated_pages: int


# -- the model ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelInfo:
    """The model a server answers for."""

    id: str
    max_model_len: int
    created: int
    tool_format: ToolFormat
    vocab_size: int  # token ids a request may name are below it
    hidden_size: int  # an embedding's length
    grammar: GrammarConfig = field(default_factory=GrammarConfig)  # what a request's constraint may cost
    reasoning_parser: ReasoningParser | None = None  # how the model's thinking is told from its answer, if it thinks
