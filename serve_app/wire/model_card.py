"""The model a server answers for: its card (`ModelInfo`), how tools and thinking reach it, and what a request's
constraint may cost on it (`GrammarConfig`, an engine setting the HTTP side checks too)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field

# How tools reach a model (`serve_app.model.tokenizer.template_tool_format` reads it off a chat template).
ToolFormat = Literal["generic", "hermes", "llama3_json", "mistral", "qwen3_coder", "deepseek_v31", "openai"]
# How a reasoning model's thinking is told from its answer (`serve_app.engine.reasoning` has each; gpt-oss's
# channels, `openai_gptoss`, are `serve_app.engine.harmony`'s).
ReasoningParser = Literal["qwen3", "deepseek_r1", "openai_gptoss"]


class GrammarConfig(BaseModel):
    """What structured output may cost: a constraint's size and nesting are checked before it compiles, compiles
    run on a pool of their own with a deadline, and compiled grammars are cached up to a byte bound."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_grammar_bytes: int = Field(
        32768, ge=64, description="a constraint's text at most (its JSON schema, tools' schemas, regex or grammar)"
    )
    max_grammar_depth: int = Field(32, ge=2, description="how deeply a JSON schema (or tool schema) may nest")
    grammar_compile_timeout_s: float = Field(
        10.0, gt=0, description="a constraint not compiled in this time is refused (400 naming its field)"
    )
    grammar_compile_threads: int = Field(1, ge=1, description="compiles running at once")
    max_pending_compiles: int = Field(
        8, ge=1, description="requests waiting for a compile at most; more are refused as overloaded"
    )
    grammar_cache_bytes: ByteSize = Field(
        ByteSize(256 * 2**20), description="compiled grammars kept for reuse at most (least recently used out)"
    )


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
