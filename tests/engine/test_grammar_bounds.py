"""What a structured-output constraint may cost: its size and nesting are refused before it compiles, a compile
that takes too long is refused, a request that goes away abandons its compile, compiles never hold up requests
without one, and compiled grammars are cached within a byte bound."""

from __future__ import annotations

import asyncio
import random
import string
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app.bench.idle import wait_idle
from serve_app.config import EngineConfig
from serve_app.engine.grammar import CompileAbandoned, GrammarCompiler
from serve_app.engine.process import EngineProcess
from serve_app.model.tokenizer import Tokenizer
from serve_app.wire.calls import GetStats
from serve_app.wire.model_card import GrammarConfig
from serve_app.wire.refusals import InvalidRequestError
from serve_app.wire.requests import EncodedRequest, GenerateRequest, StructuredOutput


def _enum(count: int, seed: int) -> dict:
    """A string enum of `count` random 60-letter values (about 62 bytes each)."""
    rng = random.Random(seed)
    return {"type": "string", "enum": ["".join(rng.choices(string.ascii_letters, k=60)) for _ in range(count)]}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.fixture(scope="module")
def grammars(tiny_llama_path: Path) -> Iterator[GrammarCompiler]:
    tokenizer = Tokenizer(tiny_llama_path)
    compiler = GrammarCompiler(tokenizer, 49152, [0], GrammarConfig(grammar_cache_bytes=8 * 2**20))
    yield compiler
    compiler.shutdown()


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutput(json=_enum(2000, 1), param="response_format"), "over max_grammar_bytes=32768"),
        (StructuredOutput(json=_nested(200), param="response_format"), "over max_grammar_depth=32"),
        (StructuredOutput(grammar="root ::= r0\n" + "\n".join(f'r{i} ::= "a" r{i + 1} | "b"' for i in range(20_000)),
                          param="structured_outputs.grammar"), "over max_grammar_bytes"),
        (StructuredOutput(regex="(a|b)" * 20_000, param="structured_outputs.regex"), "over max_grammar_bytes"),
    ],
)
def test_a_constraint_too_big_or_deep_is_refused_before_it_compiles(grammars: GrammarCompiler, spec, words: str) -> None:
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError) as refused:
        grammars.matcher(spec)
    assert refused.value.param == spec.param and words in refused.value.message
    assert time.perf_counter() - started < 1.0


def test_real_schemas_within_the_bounds_compile(grammars: GrammarCompiler) -> None:
    for schema in (_enum(400, 2), _nested(12)):
        assert grammars.matcher(StructuredOutput(json=schema)) is not None


def test_a_slow_compile_is_refused_at_its_deadline_and_a_gone_request_abandons_its_own(tiny_llama_path: Path) -> None:
    tokenizer = Tokenizer(tiny_llama_path)
    config = GrammarConfig(grammar_compile_timeout_s=0.05, grammar_compile_threads=1, max_grammar_bytes=65536)
    compiler = GrammarCompiler(tokenizer, 49152, [0], config)
    try:
        slow = StructuredOutput(json=_enum(900, 3), param="response_format")  # about a second to compile
        started = time.perf_counter()
        with pytest.raises(InvalidRequestError) as late:
            compiler.matcher(slow)
        assert late.value.param == "response_format" and "grammar_compile_timeout_s=0.05" in late.value.message
        assert time.perf_counter() - started < 0.5
        # The pool's one thread still compiles it; a request queued behind it whose client has gone never compiles.
        with pytest.raises(CompileAbandoned):
            compiler.matcher(StructuredOutput(json=_enum(900, 4)), lambda: True)
    finally:
        compiler.shutdown()


def test_the_compiled_grammar_cache_keeps_its_byte_bound(grammars: GrammarCompiler) -> None:
    for seed in range(40):  # distinct small schemas, each cached
        grammars.matcher(StructuredOutput(json={"type": "object", "properties": {f"k{seed}": {"type": "integer"}}}))
    assert 0 < grammars.cache_bytes <= 8 * 2**20


@pytest.fixture(scope="module")
def process(tiny_llama_path: Path) -> Iterator[EngineProcess]:
    options = dict(model=str(tiny_llama_path), compile=False, max_model_len=512, max_grammar_bytes=65536)
    engine = EngineProcess(EngineConfig.from_options(**options))
    yield engine
    engine.shutdown()


def test_requests_without_a_grammar_pass_compiles_and_a_gone_request_queues_nothing(process: EngineProcess) -> None:
    """Three slow compiles wait in the engine's process; a plain request is answered while they run; the callers
    that went away leave no task behind."""
    before = wait_idle(lambda: process.answer(GetStats()))

    async def scenario() -> tuple[bool, list[bool]]:
        slow = [
            asyncio.ensure_future(process.add_request_async(EncodedRequest(GenerateRequest(
                prompt=[5, 6, 7], max_tokens=2, structured_output=StructuredOutput(json=_enum(900, 10 + i))), [5, 6, 7])))
            for i in range(3)
        ]
        await asyncio.sleep(0.05)
        plain = await process.add_request_async(EncodedRequest(GenerateRequest(prompt=[5, 6, 7], max_tokens=2, temperature=0), [5, 6, 7]))
        async for _ in plain:
            pass
        still_compiling = [not s.done() for s in slow]
        for s in slow:
            s.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
        return True, still_compiling

    answered, still_compiling = asyncio.run(scenario())
    assert answered and all(still_compiling)
    time.sleep(3)  # the compile that had started ends; the withdrawn requests are refused, not queued
    after = wait_idle(lambda: process.answer(GetStats()))
    assert after["total_tasks"] - before["total_tasks"] == 1
    assert process.add_request(EncodedRequest(GenerateRequest(prompt=[5, 6], max_tokens=2), [5, 6])).wait(60).finish_reason == "length"
