"""Tool calling for both APIs: which tools a request may call (`plan`), and the format they reach the
model in (`generic` for templates that ignore tools, `native` for templates that take them)."""

from __future__ import annotations

from serve_app.http.tools.generic import GenericFormat
from serve_app.http.tools.native import (
    DeepSeekV31Format,
    HarmonyFormat,
    HermesFormat,
    Llama3JsonFormat,
    MistralFormat,
    Qwen3CoderFormat,
)
from serve_app.http.tools.plan import ToolCallFormat
from serve_app.wire.model_card import ToolFormat

_FORMATS: dict[ToolFormat, ToolCallFormat] = {
    "generic": GenericFormat(),
    "hermes": HermesFormat(),
    "llama3_json": Llama3JsonFormat(),
    "mistral": MistralFormat(),
    "qwen3_coder": Qwen3CoderFormat(),
    "deepseek_v31": DeepSeekV31Format(),
    "openai": HarmonyFormat(),
}


def format_for(name: ToolFormat) -> ToolCallFormat:
    """The tool-call format of a model, by the name the engine reports (`ModelInfo.tool_format`)."""
    return _FORMATS[name]
