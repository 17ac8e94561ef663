"""Grammars for structured output: xgrammar compiles a `StructuredOutput` over the model's tokenizer,
and a `GrammarMatcher` per request masks the logits of each step to the tokens the grammar allows.

Compiling happens where a request is submitted, never on the scheduler thread, and equal
constraints compile once (xgrammar's cache). JSON is compiled without free whitespace, so a small
model cannot fill `max_tokens` with spaces. Tool calls in a template's own format are xgrammar's
structural tags for that format (`get_model_structural_tag`).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from serve_app.engine.structured_output import StructuredOutput, ToolCallGrammar
from serve_app.errors import InvalidRequestError

if TYPE_CHECKING:
    import xgrammar

# Our tool-call formats as xgrammar's structural-tag builders name them.
_XGRAMMAR_MODEL = {"hermes": "qwen_3", "llama3_json": "llama"}

# xgrammar's errors start with a timestamp and a source location; the client needs only the rest.
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarCompiler:
    """Compiles constraints for one tokenizer (loads xgrammar on first use) and makes matchers."""

    def __init__(self, hf_tokenizer: object, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def _xgrammar(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self._hf_tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=True)
            return self._compiler

    def matcher(self, spec: StructuredOutput) -> xgrammar.GrammarMatcher:
        """A fresh matcher for `spec`; InvalidRequestError naming `spec.param` when it cannot be compiled."""
        import xgrammar

        compiler = self._xgrammar()
        try:
            match spec.kind:
                case "json":
                    compiled = compiler.compile_json_schema(json.dumps(spec.json_schema), any_whitespace=False)
                case "json_object":
                    compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
                case "regex":
                    compiled = compiler.compile_regex(spec.regex)
                case "choice":
                    alternatives = " | ".join(json.dumps(choice) for choice in spec.choice or ())
                    compiled = compiler.compile_grammar(f"root ::= {alternatives}")
                case "tool_calls":
                    compiled = compiler.compile_structural_tag(_structural_tag(spec.tool_calls))
                case _:
                    compiled = compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as error:
            message = _NOISE.sub("", str(error).strip()).split("\n")[0]
            raise InvalidRequestError(spec.param, f"cannot be enforced: {message}") from None
        return xgrammar.GrammarMatcher(compiled, override_stop_tokens=self._stop_token_ids)

    def mask(self, logits: torch.Tensor, matchers: Sequence[xgrammar.GrammarMatcher | None]) -> torch.Tensor:
        """`logits` [rows, vocab] with each constrained row's disallowed tokens at -inf (a copy)."""
        import xgrammar

        rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        bitmask = xgrammar.allocate_token_bitmask(len(matchers), self.vocab_size)
        for row in rows:
            matchers[row].fill_next_token_bitmask(bitmask, row)
        masked = logits.clone()
        xgrammar.apply_token_bitmask_inplace(masked, bitmask.to(masked.device), vocab_size=self.vocab_size, indices=rows)
        return masked


def _structural_tag(spec: ToolCallGrammar | None) -> xgrammar.StructuralTag:
    """The structural tag of `spec`'s format: free text where `auto` allows it (the template's own
    special tokens included), whitespace runs capped inside the arguments."""
    import xgrammar

    assert spec is not None
    tools = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in spec.tools]
    choice: str | dict = spec.mode
    if spec.mode == "named":
        choice = {"type": "function", "function": {"name": spec.tools[0].name}}
    return xgrammar.get_model_structural_tag(
        _XGRAMMAR_MODEL[spec.format],
        tools=tools,
        tool_choice=choice,
        reasoning="disabled",
        exclude_special_tokens=False,
        max_whitespace_cnt=1,
        parallel_tool_calls=spec.parallel,
    )
