"""Pydantic configs shared by every entry point: model, KV cache, scheduler and the engine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator

from serve_app.wire.model_card import GrammarConfig, ReasoningParser, ToolFormat

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_CACHE_TOKENS = 32768
# `ModelConfig.device` when the config does not name one: `SERVE_APP_DEVICE`, else auto.
DEVICE_ENV = "SERVE_APP_DEVICE"


def default_cache_dir() -> Path:
    """Where prepared models live: `$SERVE_APP_CACHE_DIR`, else `~/.cache/serve-app`."""
    env = os.environ.get("SERVE_APP_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "serve-app"


# A model's weights: `serve_app.model.quant.quantization` applies it.
Quantization = Literal["auto", "none", "gguf", "int8", "int4", "fp8"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """Which model to load and where it runs."""

    name: str = Field(DEFAULT_MODEL, description="an embedded model name or a local Hugging Face folder")
    device: str = Field(
        default_factory=lambda: os.environ.get(DEVICE_ENV, "auto"),
        description=f"auto (CUDA when present, else CPU), cpu, cuda, cuda:N; unset: ${DEVICE_ENV}, else auto",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    max_model_len: int | None = Field(None, ge=2, description="context limit; defaults to the model's")
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads; defaults to every core, in a Serve replica to its num_cpus"
    )
    decode_attention: Literal["auto", "torch"] = Field(
        "auto",
        description="auto: the paged C kernel on CPU with float32 where it builds, else torch; torch: gather + SDPA",
    )
    tool_call_format: Literal["auto"] | ToolFormat = Field(
        "auto",
        description="how tools reach the model (vLLM's tool_call_parser): auto reads the chat template (hermes for "
        "<tool_call> templates, llama3_json for Llama 3.1+, mistral for [TOOL_CALLS]name[ARGS], qwen3_coder for "
        "Qwen3-Coder's XML, deepseek_v31 for DeepSeek-V3.1's, openai for gpt-oss's harmony channels, generic for "
        "templates that ignore tools)",
    )
    reasoning_parser: ReasoningParser | None = Field(
        None,
        description="vLLM's name: the model thinks in <think>...</think> before it answers (qwen3, deepseek_r1), or in "
        "gpt-oss's analysis channel (openai_gptoss: the default of a harmony template); the thinking is returned "
        "apart from the answer, and grammars and tools apply to the answer only",
    )
    compile: bool = Field(
        True,
        description="torch.compile the forward (inductor, dynamic token counts) at start, its artifacts cached on disk "
        "under cache_dir/compile (a second start loads them); where it cannot be built, eager with a warning",
    )
    quantization: Quantization = Field(
        "auto",
        description="auto: gguf where the model was made from a GGUF file and runs on the CPU in float32, else none; "
        "gguf (a model made from a GGUF, on the CPU in float32): the file's Q4_1 and Q8_0 weights served as "
        "stored, with float32 activations; "
        "int8: every linear layer with int8 weights, on the CPU with dynamic int8 activations (fbgemm), "
        "elsewhere weights only (torchao); int4 (the CPU): 4-bit weights in groups of 32 with bfloat16 activations, "
        "a GGUF's Q4_1 weights taken as stored; fp8: fp8 weights only (torchao, for CUDA)",
    )
    cache_dir: Path = Field(default_factory=default_cache_dir)
    dynamic_lora_loading_path: Path | None = Field(
        None, description="a folder of LoRA adapters (PEFT folders, one per adapter name), each loaded on first use"
    )
    lora_paths: dict[str, Path] = Field(
        default_factory=dict, description="named LoRA adapters: name -> PEFT folder, next to those of the loading path"
    )
    max_num_adapters_per_replica: int = Field(8, ge=1, description="LoRA adapters held at once; least recently used out")
    max_lora_rank: int = Field(16, ge=1, description="the largest LoRA rank an adapter may have")

    @property
    def serves_adapters(self) -> bool:
        return self.dynamic_lora_loading_path is not None or bool(self.lora_paths)


class CacheConfig(_Strict):
    """The KV cache: its kind and its size, in tokens or bytes (tokens win when both are set); with
    neither, on CUDA a share of the device's memory (`gpu_memory_utilization`), else
    DEFAULT_CACHE_TOKENS."""

    kind: Literal["paged", "contiguous"] = "paged"
    page_size: int = Field(16, ge=1, le=1024)
    kv_cache_dtype: Literal["auto", "bfloat16", "float16"] = Field(
        "auto",
        description="the cache's element type (vLLM's name): auto, the model's dtype; bfloat16 or float16 halve a "
        "float32 model's KV bytes per token (twice the tokens in the same memory, half the read per decode step), "
        "k and v rounded as they are stored and widened as they are read",
    )
    num_tokens: int | None = Field(None, ge=1)
    num_bytes: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1,
        description="on CUDA with no size set: the share of the device's memory the process may hold, the cache "
        "taking what the model and a reserve for activations leave of it",
    )


class SchedulerConfig(_Strict):
    """Limits of the continuous-batching loop."""

    max_num_seqs: int = Field(128, ge=1, description="running tasks at most")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="who is admitted first: first come first served, or by each request's `priority` (lower first, "
        "then arrival; under memory pressure the last of that order is preempted), as vLLM's",
    )
    max_num_batched_tokens: int = Field(512, ge=1, description="tokens in one forward at most")
    background_step_s: float = Field(
        0.03, gt=0,
        description="a batch's (background) tasks add about this much time at most to a step, by the recent steps' "
        "times (and at least one token): an online request that arrives waits no longer for the step in flight",
    )
    max_waiting_requests: int = Field(1024, ge=1, description="requests waiting for admission at most; more are refused")
    max_pending_calls: int = Field(16, ge=1, description="KV and other calls waiting for the scheduler at most")
    call_timeout_s: float = Field(60.0, gt=0, description="a call not taken by the scheduler in this time is dropped")
    max_consecutive_failed_steps: int = Field(
        3, ge=1, description="steps in a row that fail every request before the engine reports itself unhealthy"
    )


class KVTiersConfig(_Strict):
    """Stores of whole KV pages behind the page pool (`serve_app.kv.tiers`): every page the pool publishes
    is written to the host and disk tiers, and a prompt whose pages left the pool loads them back. Sizes
    take bytes or strings such as "4GiB"."""

    host_bytes: ByteSize | None = Field(
        None, description="the host tier: this node's page store (a Ray actor, pages in the object store), shared by "
        "every engine on the node and kept across engine restarts; the first engine on a node sizes it",
    )
    disk_path: Path | None = Field(None, description="the disk tier: a folder of page files, each with a checksum")
    disk_bytes: ByteSize = Field(ByteSize(16 * 2**30), description="what this engine keeps under disk_path at most")
    cluster: bool = Field(False, description="the cluster tier: fetch pages other nodes' host tiers hold, through Ray")
    ray_address: str | None = Field(
        None, description="the Ray cluster of the host and cluster tiers; an engine replica sets it to its own; "
        "unset: the current connection, else ray.init(address='auto')",
    )
    node_id: str | None = Field(None, description="the Ray node whose host tier to use; unset: the connection's own")

    @property
    def enabled(self) -> bool:
        return self.host_bytes is not None or self.disk_path is not None or self.cluster

    @property
    def needs_ray(self) -> bool:
        return self.host_bytes is not None or self.cluster


class SpeculativeConfig(_Strict):
    """Speculative decoding, as vLLM's `speculative_config` names it: each decode row proposes up to
    `num_speculative_tokens` tokens, which one forward verifies (`serve_app.engine.speculation`)."""

    method: Literal["ngram"] = Field(
        description="ngram: prompt lookup, the tokens that followed the latest earlier occurrence of the request's "
        "last n tokens (n from prompt_lookup_max down to prompt_lookup_min) in its prompt and output",
    )
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="tokens proposed per decode row at most")
    prompt_lookup_min: int = Field(2, ge=1, description="the shortest n-gram matched")
    prompt_lookup_max: int = Field(5, ge=1, description="the longest n-gram matched")
    disable_by_batch_size: int | None = Field(
        None, ge=1, description="steps with more decode rows than this propose nothing; None: no such bound (a step "
        "proposes only tokens likely enough to be accepted to pay for their share of its time, fewer as it fills)",
    )

    @model_validator(mode="after")
    def _check_lookup(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        return self


# The engine's flat options (`InferenceEngine(**options)`, the app's `engine_kwargs`): name -> (section, field).
FLAT_OPTIONS: dict[str, tuple[str, str]] = {
    "model": ("model", "name"),
    "device": ("model", "device"),
    "dtype": ("model", "dtype"),
    "max_model_len": ("model", "max_model_len"),
    "num_threads": ("model", "num_threads"),
    "decode_attention": ("model", "decode_attention"),
    "cache_dir": ("model", "cache_dir"),
    "tool_call_format": ("model", "tool_call_format"),
    "tool_call_parser": ("model", "tool_call_format"),  # vLLM's name for it
    "reasoning_parser": ("model", "reasoning_parser"),
    "quantization": ("model", "quantization"),
    "compile": ("model", "compile"),
    "dynamic_lora_loading_path": ("model", "dynamic_lora_loading_path"),
    "lora_paths": ("model", "lora_paths"),
    "max_num_adapters_per_replica": ("model", "max_num_adapters_per_replica"),
    "max_lora_rank": ("model", "max_lora_rank"),
    "kv_cache": ("cache", "kind"),
    "page_size": ("cache", "page_size"),
    "kv_cache_dtype": ("cache", "kv_cache_dtype"),
    "cache_tokens": ("cache", "num_tokens"),
    "cache_bytes": ("cache", "num_bytes"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "gpu_memory_utilization": ("cache", "gpu_memory_utilization"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "scheduling_policy": ("scheduler", "scheduling_policy"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "background_step_s": ("scheduler", "background_step_s"),
    "max_waiting_requests": ("scheduler", "max_waiting_requests"),
    "max_pending_calls": ("scheduler", "max_pending_calls"),
    "call_timeout_s": ("scheduler", "call_timeout_s"),
    "max_consecutive_failed_steps": ("scheduler", "max_consecutive_failed_steps"),
    "kv_tiers": ("tiers", ""),  # the whole section: {host_bytes: 4GiB, disk_path: ..., cluster: true}
    "speculative_config": ("speculative", ""),  # the whole section: {method: ngram, num_speculative_tokens: 4}
    "max_grammar_bytes": ("grammar", "max_grammar_bytes"),
    "max_grammar_depth": ("grammar", "max_grammar_depth"),
    "grammar_compile_timeout_s": ("grammar", "grammar_compile_timeout_s"),
    "grammar_compile_threads": ("grammar", "grammar_compile_threads"),
    "max_pending_compiles": ("grammar", "max_pending_compiles"),
    "grammar_cache_bytes": ("grammar", "grammar_cache_bytes"),
    "log_level": ("logging", "log_level"),
    "log_stats_interval_s": ("logging", "log_stats_interval_s"),
}


class LoggingConfig(_Strict):
    """What the engine logs."""

    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="the engine's log level")
    log_stats_interval_s: float = Field(
        10.0, ge=0, description="seconds between the engine's throughput lines while it is busy; 0: none"
    )


class EngineConfig(_Strict):
    """Everything an `InferenceEngine` needs; build it nested or from flat keyword options."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    tiers: KVTiersConfig = Field(default_factory=KVTiersConfig)
    speculative: SpeculativeConfig | None = None
    grammar: GrammarConfig = Field(default_factory=GrammarConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="after")
    def _check_batch_fits(self) -> EngineConfig:
        if self.scheduler.max_num_batched_tokens < self.scheduler.max_num_seqs:
            # Every running task needs its decode token in one step.
            raise ValueError(
                "scheduler.max_num_batched_tokens must be >= scheduler.max_num_seqs "
                f"({self.scheduler.max_num_batched_tokens} < {self.scheduler.max_num_seqs})"
            )
        if self.tiers.enabled and (self.cache.kind != "paged" or not self.cache.enable_prefix_caching):
            raise ValueError("kv_tiers: they hold the prefix cache's pages: use kv_cache paged with enable_prefix_caching")
        return self

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Build from flat options such as `model=`, `kv_cache=`, `page_size=`, `cache_tokens=`."""
        return cls().with_options(**options)

    def with_options(self, **options: Any) -> EngineConfig:
        """A copy with flat options applied on top."""
        data = self.model_dump()
        if {"tool_call_format", "tool_call_parser"} <= options.keys():
            raise ValueError("tool_call_parser is tool_call_format's other name: give one")
        for key, value in options.items():
            if key not in FLAT_OPTIONS:
                raise ValueError(f"unknown engine option {key!r}; known: {', '.join(sorted(FLAT_OPTIONS))}")
            section, field = FLAT_OPTIONS[key]
            if field:
                data[section][field] = value
            else:
                data[section] = value
        return type(self).model_validate(data)


class ServerConfig(_Strict):
    """The HTTP side: request limits, tenants and stored responses."""

    max_request_bytes: int = Field(
        1024 * 1024, ge=1024,
        description="larger request bodies get 413 (read and parsed, a body holds the ingress for about 35 ms a MiB "
        "on a slow 2-core host; raise it for long-context models)",
    )
    max_kv_bytes: int = Field(1024**3, ge=1024, description="larger `/v1/kv/store` bodies get 413")
    max_n: int = Field(16, ge=1, description="choices per request at most")
    max_choices: int = Field(
        128, ge=1, description="engine requests one request makes at most: its prompts (legacy completions) times n"
    )
    max_prompt_characters: int | None = Field(
        None, ge=1,
        description="characters of a prompt (a chat's messages and tools) at most, checked before tokenizing; None: "
        "16 per token of the model's context",
    )
    max_stop_sequences: int = Field(16, ge=0, description="stop sequences per request at most")
    max_stop_length: int = Field(256, ge=1, description="characters per stop sequence at most")
    max_messages: int = Field(1024, ge=1, description="chat messages per request at most")
    max_output_tokens: int | None = Field(None, ge=1, description="new tokens per request at most; None: the context")
    max_constrained_tokens: int | None = Field(
        1024, ge=1,
        description="a request that sets no output-token limit: its tokens inside constrained JSON (its tool calls, "
        "or a JSON answer) at most, then it ends as cut by the limit; None: no such bound",
    )
    unknown_fields: Literal["reject", "warn"] = Field(
        "reject",
        description="a request field its API does not have: a 400 naming it, as OpenAI's API answers (reject), or "
        "accepted and logged once per field, as vLLM does (warn: for clients that send vendor fields)",
    )
    metrics_names: Literal["serve_app", "vllm"] = Field(
        "serve_app",
        description="how /metrics names its series: `serve_app:*` labelled replica, or vLLM's own `vllm:*` labelled "
        "engine (for vLLM's Grafana dashboard and autoscaler recipes keyed on vllm:num_requests_waiting)",
    )
    max_concurrent_per_tenant: int = Field(256, ge=1, description="a tenant's requests in flight per ingress; 429 past it")
    api_keys_file: str | None = Field(
        None, description="YAML or JSON: API key -> {tenant, role}; default: the file SERVE_APP_API_KEYS names"
    )
    cache_salt_secret: str | None = Field(
        None, description="the HMAC secret of cache salts; unset: cache_salt_secret_file, else one kept in the cache folder"
    )
    cache_salt_secret_file: str | None = Field(
        None, description="a file holding the HMAC secret of cache salts (a mounted Secret), read where the app is built"
    )
    open_mode_admin: Literal["loopback", "anywhere"] = Field(
        "loopback",
        description="without API keys, who may use the KV and admin routes: every caller where Serve's HTTP host is a "
        "loopback address (loopback), or wherever it listens (anywhere); elsewhere only generation is served",
    )
    max_stored_responses: int = Field(
        1000, ge=0, description="Responses-API responses kept per tenant for previous_response_id; 0: none"
    )
    stored_response_max_age_s: float = Field(3600.0, gt=0, description="a stored response is dropped after this long")
    batch_files_path: Path | None = Field(
        None, description="where the Batch API keeps tenants' files and batches; None: the cache folder's `batches`"
    )
    max_batch_file_bytes: ByteSize = Field(ByteSize(100 * 2**20), ge=1024, description="an uploaded file's bytes at most")
    max_batch_bytes_per_tenant: ByteSize = Field(
        ByteSize(2**30), ge=1024, description="a tenant's files (uploads and batch results) at most, in bytes"
    )
    max_batch_lines: int = Field(50_000, ge=1, description="requests in a batch's input file at most")
    batch_concurrency: int = Field(
        16, ge=1, description="a batch's requests in flight at once: what batches take of the engines beside online traffic"
    )
    otlp_traces_endpoint: str | None = Field(
        None, description="an OTLP/HTTP traces endpoint (e.g. http://collector:4318/v1/traces): a span per request "
        "in the ingress, the router and the engine; None: no tracing",
    )
