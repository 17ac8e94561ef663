"""The CLI's parser: help that shows each option's default, one help text for the options several commands share
(one name, one meaning), and the list types of comma-separated options."""

from __future__ import annotations

import argparse
from typing import Any


def str_list(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def quantization_list(text: str) -> list[str]:
    kinds = str_list(text)
    if not kinds or any(kind not in ("int8", "int4", "fp8") for kind in kinds):
        raise argparse.ArgumentTypeError(f"{text!r}: int8, int4, fp8 or several, comma-separated")
    return kinds


def add_engine_form(parser: argparse.ArgumentParser) -> None:
    """The options of the engine's form that several benches take: its compiled forward, its weights, its KV
    cache's element type."""
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="the engine's compiled forward"
    )
    parser.add_argument("--quantization", default="none", choices=["none", "gguf", "int8", "int4"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float16"])


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


class HelpFormatter(argparse.HelpFormatter):
    """Each option's help followed by its default, where it has one; a list's as it is typed."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or default is None or default is False or default == argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(default, list):  # as it is typed: 1,8,32
            return f"{text} (default: {','.join(map(str, default)) or 'none'})".replace("%", "%%")
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """A parser whose help shows defaults; the options that several commands share get their one help text."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def format_help(self) -> str:
        for action in self._actions:
            if action.help is None and action.dest in SHARED_HELP:
                action.help = SHARED_HELP[action.dest]
        return super().format_help()


# The help of the options several commands share: one name, one meaning.
SHARED_HELP = {
    "model": "the model: an embedded model name or a local Hugging Face folder",
    "json": "also write the report to this JSON file",
    "seed": "seed of the prompt set",
    "max_tokens": "new tokens per request",
    "requests": "number of requests",
    "concurrency": "requests in flight; a comma list sweeps, e.g. 1,8,32",
    "device": "where it runs: cpu, cuda, cuda:N",
    "quantization": "the model's weights: none, gguf (a GGUF's own blocks), int8 or int4",
    "page_size": "tokens per KV page",
    "kv_cache_dtype": "the KV cache's element type: auto (the model's), bfloat16 or float16",
    "rounds": "rounds to repeat (alternating where it compares)",
    "conversations": "conversations",
    "turns": "turns per conversation",
    "max_model_len": "context limit per request",
    "cache_tokens": "the KV cache's size, in tokens",
}
