"""Grammars for structured output: xgrammar compiles a `StructuredOutput` over the model's tokenizer,
and a `GrammarMatcher` per request masks the logits of each step to the tokens the grammar allows.

Compiling happens where a request is submitted, never on the scheduler thread, and its cost is bounded
before it starts: a constraint over `max_grammar_bytes` or nested deeper than `max_grammar_depth` is refused
unread; compiles run on a pool of their own (`grammar_compile_threads`, at a lower CPU priority than the
steps, at most `max_pending_compiles` waiting), a compile not done by `grammar_compile_timeout_s` is
refused, and one whose request has gone is abandoned (a compile that has started runs to its end: the size
bounds keep that short). Equal constraints compile once (xgrammar's cache, held to `grammar_cache_bytes`).
JSON is compiled without free whitespace, so a small model cannot fill `max_tokens` with spaces. Tool calls in the generic format are a JSON schema (the
calls, or the answer); in a template's own format, xgrammar's structural tag for that format
(`get_model_structural_tag`), or that tag's calls beside the answer's schema (`serve_app.engine.grammar_formats`).
A harmony model's grammars (gpt-oss's) hold its message stream: the constraint applies to the final message or the
calls (`serve_app.engine.harmony_grammar`).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_future
from typing import TYPE_CHECKING

import torch

from serve_app.answers.by_format import reader_for
from serve_app.engine.answer_guard import AnswerGuard
from serve_app.engine.grammar_bounds import check_size
from serve_app.engine.grammar_formats import generic_schema, harmony_tag, structural_tag
from serve_app.wire.model_card import GrammarConfig
from serve_app.wire.refusals import EngineOverloadedError, InvalidRequestError
from serve_app.wire.requests import StructuredOutput

if TYPE_CHECKING:
    import xgrammar

    from serve_app.model.detokenizer import IncrementalDetokenizer
    from serve_app.model.tokenizer import Tokenizer
    from serve_app.wire.requests import GenerateRequest

# xgrammar's errors start with a timestamp and a source location; the client needs only the rest.
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# How much less CPU priority a compile thread has than the scheduler's.
COMPILE_NICENESS = 10
# How often a request waiting for its compile looks whether it has gone.
_WITHDRAWN_POLL_S = 0.05


class CompileAbandoned(Exception):
    """The request whose grammar was compiling has gone: nothing was queued for it."""


class GrammarCompiler:
    """Compiles constraints for one tokenizer (loads xgrammar on first use) and makes matchers."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        config: GrammarConfig | None = None,
        harmony: bool = False,
    ) -> None:
        self._hf_tokenizer = tokenizer.transformers_tokenizer()  # what xgrammar reads the vocabulary from
        self._harmony = harmony  # the model answers in harmony messages: every grammar holds their stream
        self.vocab_size = vocab_size
        self.config = config or GrammarConfig()
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            self.config.grammar_compile_threads, thread_name_prefix="grammar-compile", initializer=_yield_to_steps
        )
        self._waiting = threading.BoundedSemaphore(self.config.max_pending_compiles)
        quote = tokenizer.encode('"', add_special_tokens=False)
        self.quote_token: int | None = quote[0] if len(quote) == 1 else None  # closes a JSON string in one token

    def _xgrammar(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self._hf_tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgrammar.GrammarCompiler(  # made on a compile thread: its threads share its priority
                    info, max_threads=1, cache_enabled=True, cache_limit_bytes=int(self.config.grammar_cache_bytes)
                )
            return self._compiler

    @property
    def cache_bytes(self) -> int:
        """What the compiled grammars kept for reuse hold now."""
        with self._lock:
            return self._compiler.get_cache_size_bytes() if self._compiler is not None else 0

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def matcher(
        self, spec: StructuredOutput, withdrawn: Callable[[], bool] = lambda: False, analysis: bool = True
    ) -> xgrammar.GrammarMatcher:
        """A fresh matcher for `spec`, once its size is checked and it compiled on the pool in time: InvalidRequestError
        naming `spec.param` when it is too big or cannot be compiled, EngineOverloadedError when too many wait for a
        compile, CompileAbandoned when `withdrawn()` says the request went away meanwhile. `analysis`: a harmony
        model may think (write an analysis message) before the answer."""
        import xgrammar

        check_size(spec, self.config)
        if not self._waiting.acquire(blocking=False):
            raise EngineOverloadedError(
                f"the engine is overloaded: max_pending_compiles={self.config.max_pending_compiles} requests wait for a grammar"
            )
        try:
            compiled = self._wait(self._pool.submit(self._compile, spec, analysis), spec, withdrawn)
        finally:
            self._waiting.release()
        return xgrammar.GrammarMatcher(compiled, override_stop_tokens=self._stop_token_ids)

    def _wait(self, future: Future, spec: StructuredOutput, withdrawn: Callable[[], bool]) -> xgrammar.CompiledGrammar:
        timeout = self.config.grammar_compile_timeout_s
        deadline = time.monotonic() + timeout
        while not wait_for_future([future], _WITHDRAWN_POLL_S).done:
            if withdrawn():
                future.cancel()
                raise CompileAbandoned(f"{spec.param}: the request went away while its grammar compiled")
            if time.monotonic() >= deadline:
                future.cancel()
                raise InvalidRequestError(
                    spec.param, f"did not compile within grammar_compile_timeout_s={timeout:g}: make it smaller"
                )
        return future.result()

    def _compile(self, spec: StructuredOutput, analysis: bool) -> xgrammar.CompiledGrammar:
        compiler = self._xgrammar()
        try:
            if self._harmony:
                return compiler.compile_structural_tag(harmony_tag(spec, analysis))
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
                case "tool_calls" if spec.tool_calls is not None and spec.tool_calls.format == "generic":
                    compiled = compiler.compile_json_schema(json.dumps(generic_schema(spec.tool_calls)), any_whitespace=False)
                case "tool_calls":
                    compiled = compiler.compile_structural_tag(structural_tag(spec.tool_calls))
                case _:
                    compiled = compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as error:
            message = _NOISE.sub("", str(error).strip()).split("\n")[0]
            raise InvalidRequestError(spec.param, f"cannot be enforced: {message}") from None
        return compiled

    def guard(self, request: GenerateRequest, text: Callable[[], IncrementalDetokenizer]) -> AnswerGuard | None:
        """What holds `request`'s answer beyond its grammar (a JSON or tool-call answer's repeats and
        lengths), reading the answer's text through `text()`; InvalidRequestError where it sets a JSON answer's
        limit without one."""
        spec = request.structured_output
        limits = {"max_string_tokens": request.max_string_tokens, "max_constrained_tokens": request.max_constrained_tokens}
        for name, value in limits.items():
            if value is not None and (spec is None or not spec.is_json):
                raise InvalidRequestError(name, "applies to a JSON answer: give it with a JSON schema, json_object or tools")
        if request.max_string_tokens is not None and self.quote_token is None:
            raise InvalidRequestError("max_string_tokens", "this tokenizer has no single token that closes a string")
        if request.max_string_tokens is not None and spec is not None and spec.tool_calls is not None:
            if spec.tool_calls.format == "qwen3_coder":
                raise InvalidRequestError("max_string_tokens", "this model's calls (qwen3_coder) write values as XML, not JSON strings")
        # A plain JSON answer with neither limit has nothing to guard: no reading per token then.
        if spec is None or (spec.tool_calls is None and not any(v is not None for v in limits.values())):
            return None
        reader = reader_for(spec)
        assert reader is not None, "a tool-call or limited JSON answer has a reader"
        return AnswerGuard(reader, text(), self.quote_token, request.max_string_tokens, request.max_constrained_tokens)

    def mask(
        self,
        logits: torch.Tensor,
        matchers: Sequence[xgrammar.GrammarMatcher | None],
        forced: Sequence[int | None] = (),
    ) -> torch.Tensor:
        """`logits` [rows, vocab] with each constrained row's disallowed tokens at -inf (a copy); a row with a
        `forced` token allows only that one, where its grammar allows it."""
        import xgrammar

        rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        bitmask = xgrammar.allocate_token_bitmask(len(matchers), self.vocab_size)
        for row in rows:
            matchers[row].fill_next_token_bitmask(bitmask, row)
        for row, token in enumerate(forced):
            if token is not None and matchers[row] is not None and _allows(bitmask[row], token):
                bitmask[row] = 0
                bitmask[row, token // 32] = _bit(token)
        masked = logits.clone()
        xgrammar.apply_token_bitmask_inplace(masked, bitmask.to(masked.device), vocab_size=self.vocab_size, indices=rows)
        return masked


def _yield_to_steps() -> None:
    """A compile thread runs at a lower CPU priority (niceness +10) than the model's steps, so a compile as big as the
    bounds allow slows the requests decoding beside it little (Linux gives each thread its own niceness)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + COMPILE_NICENESS)
    except (AttributeError, OSError):  # not Linux: compiles share the CPU evenly
        pass


def _allows(row: torch.Tensor, token: int) -> bool:
    """Whether a bitmask row (32 tokens per int32 word) allows `token`."""
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def _bit(token: int) -> int:
    """`token`'s bit in its int32 word, as a signed value."""
    bit = 1 << (token % 32)
    return bit - (1 << 32) if bit >= 1 << 31 else bit
