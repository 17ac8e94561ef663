"""InferenceEngine: the in-process API over the model runner, the KV cache and the scheduler thread."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any, TypeVar

import torch

from serve_app.config import EngineConfig, ToolFormat
from serve_app.engine.activity_log import ActivityLog, log_start
from serve_app.engine.grammar import GrammarCompiler
from serve_app.engine.io import (
    TIER_NAMES,
    CountTokens,
    EngineCall,
    GenerateRequest,
    GetKVConfig,
    GetStats,
    KVConfig,
    KVLookup,
    ListAdapters,
    LookupKV,
    RetrieveKV,
    StoreKV,
    StoreResult,
    StreamDelta,
)
from serve_app.engine.loop import EngineLoop
from serve_app.engine.result import GenerateResult
from serve_app.engine.scheduler import Scheduler, SchedulerStats
from serve_app.engine.speculation import SpeculationStats, Speculator
from serve_app.engine.step import ModelStep
from serve_app.engine.stopping import StopStringMatcher
from serve_app.engine.task import Task
from serve_app.engine.tier_loading import TierLoading
from serve_app.errors import InvalidRequestError
from serve_app.kv.base import KVCache
from serve_app.kv.factory import build_kv_cache
from serve_app.kv.page_cache import PageCache
from serve_app.kv.page_events import PageEventLog
from serve_app.kv.prefix_cache import page_hashes
from serve_app.kv.tiers.layout import layout_key
from serve_app.kv.tiers.tier_chain import TierChain
from serve_app.kv.transfer import KVTransfer
from serve_app.model.detokenizer import IncrementalDetokenizer
from serve_app.model.runner import ModelRunner
from serve_app.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int]


T = TypeVar("T")


def _on_a_thread_of_its_own(build: Callable[[], T]) -> T:
    """What `build` returns, built on a thread that then ends. On CPU, torch's OpenMP runtime gives every
    thread that runs a parallel op a worker pool of its own, and while a second pool lives beside the
    scheduler thread's, each step's ops run several times slower (a linear layer of this model on 32
    tokens: 0.26 ms alone, 0.39 ms so; its int8 form 0.12 ms against 0.55). Loading the model here
    leaves the calling thread (an engine process's main thread) without a pool, so the scheduler
    thread's is the only one."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(build())
        except BaseException as error:  # raised again on the calling thread
            failure.append(error)

    thread = threading.Thread(target=run, name="engine-loader")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]


class InferenceEngine:
    """Loads a model and serves generation requests from a continuous-batching scheduler thread.

    `InferenceEngine(model="smollm2-135m-instruct", kv_cache="paged")`; further options are the
    flat keys of `EngineConfig.from_options` (`page_size`, `cache_tokens`, `max_num_seqs`, ...).
    """

    def __init__(
        self,
        model: str | None = None,
        kv_cache: str | None = None,
        *,
        config: EngineConfig | None = None,
        **options: Any,
    ) -> None:
        if model is not None:
            options["model"] = model
        if kv_cache is not None:
            options["kv_cache"] = kv_cache
        self.config = (config or EngineConfig()).with_options(**options)
        logging.getLogger("serve_app").setLevel(self.config.logging.log_level.upper())
        self.runner, self.cache = _on_a_thread_of_its_own(self._load)
        self.max_model_len = self.runner.max_model_len
        chosen = self.config.model.tool_call_format
        self.tool_format: ToolFormat = self.tokenizer.tool_format if chosen == "auto" else chosen
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.runner.vocab_size, self.tokenizer.eos_token_ids)
        speculative = self.config.speculative
        self.scheduler = Scheduler(
            self.cache, self.config.scheduler, self.max_model_len, Speculator(speculative) if speculative is not None else None
        )
        self.loop = EngineLoop(self.scheduler, ModelStep(self.runner, self.scheduler, self.grammars))
        self._transfer = (
            KVTransfer(self.cache, self.runner.vocab_size)
            if isinstance(self.cache, PageCache) and self.cache.enable_prefix_caching
            else None
        )
        self.tiers = self._start_tiers()  # None without kv_tiers
        self._task_ids = itertools.count(1)
        self.created = int(time.time())
        self.loop.start()
        log_start(self)
        interval = self.config.logging.log_stats_interval_s
        self._activity = ActivityLog(self.get_stats, interval) if interval > 0 else None

    def _load(self) -> tuple[ModelRunner, KVCache]:
        runner = ModelRunner(self.config.model)
        scheduler = self.config.scheduler
        activations = runner.activation_bytes(scheduler.max_num_batched_tokens, self._max_sampled_rows())
        cache = build_kv_cache(self.config.cache, runner.kv_shape, runner.max_model_len, runner.device, activations)
        if self.config.model.compile:
            runner.compile(cache.storage)
        return runner, cache

    def _max_sampled_rows(self) -> int:
        """The most rows one step samples: one per running task, and each proposal where speculating."""
        rows = self.config.scheduler.max_num_seqs
        speculative = self.config.speculative
        if speculative is not None:
            rows += min(rows, speculative.disable_by_batch_size or rows) * speculative.num_speculative_tokens
        return min(rows, self.config.scheduler.max_num_batched_tokens)

    def _start_tiers(self) -> TierChain | None:
        """The KV tiers behind the page pool, when the config names any (it then has a paged cache)."""
        config = self.config
        if not config.tiers.enabled:
            return None
        assert isinstance(self.cache, PageCache)
        layout = layout_key(self.runner.path, config.model.cache_dir, config.model.quantization, self.cache.page_size,
                            self.runner.kv_shape)
        chain = TierChain(config.tiers, layout, self.loop.deliver_loaded)
        self.cache.pool.record_published()
        self.scheduler.tiers = TierLoading(self.cache, chain)
        logger.info("KV tiers behind the pool: %s", ", ".join(source.name for source in chain.sources))
        return chain

    @property
    def tokenizer(self) -> Tokenizer:
        return self.runner.tokenizer

    # -- submitting ---------------------------------------------------------------------------
    def submit(self, request: GenerateRequest) -> GenerateResult:
        """Validate, tokenize and queue one request; raise ValueError before queueing anything bad."""
        prompt_ids = self.prompt_ids(request)
        max_tokens = self._check_lengths(prompt_ids, request.max_tokens)
        vocab = self.runner.vocab_size
        for field, ids in (("prompt", prompt_ids), ("stop_token_ids", request.stop_token_ids)):
            bad = next((i for i in ids if not 0 <= i < vocab), None)
            if bad is not None:
                raise InvalidRequestError(field, f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        params = request.sampling
        # Compiling a grammar takes milliseconds to a second: here, never on the scheduler thread.
        matcher = self.grammars.matcher(request.structured_output) if request.structured_output else None
        guard = self.grammars.guard(request)
        stop_ids = set(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= self.tokenizer.eos_token_ids
        slot = self._adapter_slot(request.lora)
        task_id = next(self._task_ids)
        result = GenerateResult(task_id=task_id, prompt_tokens=len(prompt_ids), _on_abandon=self.abort)
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed)
        task = Task(
            task_id=task_id,
            prompt_len=len(prompt_ids),
            tokens=list(prompt_ids),
            params=params,
            max_tokens=max_tokens,
            stop_token_ids=frozenset(stop_ids),
            cache_salt=request.prefix_salt,
            result=result,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids),
            stop_strings=StopStringMatcher(request.stop),
            generator=generator,
            logprobs=request.logprobs,
            matcher=matcher,
            guard=guard,
            adapter_slot=slot,
            on_finished=self._releaser(slot),
        )
        try:
            self.loop.submit(task)
        except BaseException:
            if task.on_finished is not None:
                task.on_finished()
            raise
        return result

    def _adapter_slot(self, name: str | None) -> int | None:
        """The slot of LoRA adapter `name`, held for one request (None for the base model)."""
        if name is None:
            return None
        adapters = self.runner.adapters
        if adapters is None:
            raise InvalidRequestError("lora", "this engine serves no adapters (set dynamic_lora_loading_path or lora_paths)")
        return adapters.acquire(name)

    def _releaser(self, slot: int | None) -> Callable[[], None] | None:
        adapters = self.runner.adapters
        if slot is None or adapters is None:
            return None
        return lambda: adapters.release(slot)

    async def submit_async(self, request: GenerateRequest) -> GenerateResult:
        """`submit` off the event loop (it tokenizes). A caller cancelled meanwhile leaves nothing running."""
        gone = threading.Event()

        def submit() -> GenerateResult:
            result = self.submit(request)
            if gone.is_set():
                self.abort(result.task_id)
            return result

        submitting = asyncio.ensure_future(asyncio.to_thread(submit))
        try:
            return await asyncio.shield(submitting)
        except asyncio.CancelledError:
            gone.set()
            submitting.add_done_callback(self._abort_submitted)
            raise

    def _abort_submitted(self, submitting: asyncio.Future) -> None:
        """A submit whose caller left after it began: abort what it queued (a second abort is harmless)."""
        if not submitting.cancelled() and submitting.exception() is None:
            self.abort(submitting.result().task_id)

    def _check_lengths(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """The request's token budget; the prompt and `max_tokens` must fit the context and the cache."""
        limit = min(self.max_model_len, self.cache.max_task_tokens)
        if len(prompt_ids) >= limit:
            raise InvalidRequestError(
                "prompt",
                f"{len(prompt_ids)} tokens leave no room to generate "
                f"(max_model_len={self.max_model_len}, the cache holds {self.cache.max_task_tokens} tokens per request)",
            )
        room = limit - len(prompt_ids)
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise InvalidRequestError(
                "max_tokens",
                f"{max_tokens} new tokens do not fit: the prompt has {len(prompt_ids)} tokens and the context "
                f"holds {limit}, so at most {room} can be generated",
            )
        return max_tokens

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The token ids the engine feeds for a request: chat through the template, text encoded, ids as they are."""
        return self.tokenizer.prompt_ids(request.prompt, request.messages, request.tools)

    def record_page_events(self) -> PageEventLog | None:
        """Log the page hashes the prefix cache publishes and drops (None without one). Drain the log on
        the scheduler thread (a step listener): the cache changes there."""
        if self._transfer is None:
            return None
        assert isinstance(self.cache, PageCache)
        return self.cache.pool.prefix_cache.record_events()

    def abort(self, task_id: int) -> None:
        """Cancel a task; its cache is freed at the next step."""
        self.loop.abort(task_id)

    def answer(self, call: EngineCall) -> Any:
        """What `call` asks of the engine (see the calls in `serve_app.engine.io`); raises what the engine refuses."""
        match call:
            case CountTokens(request):
                return len(self.prompt_ids(request))
            case GetStats():
                return self.get_stats()
            case GetKVConfig():
                return self.kv_config()
            case LookupKV(tokens, cache_salt):
                pages = self.kv_locate(tokens, cache_salt)
                return KVLookup(pages.count("pool") * self._kv_transfer().page_size, tuple(pages))
            case RetrieveKV(tokens, cache_salt):
                return self.kv_retrieve(tokens, cache_salt)
            case StoreKV(kv, tokens, cache_salt):
                return self.kv_store_pages(kv, tokens, cache_salt)
            case ListAdapters():
                return self.runner.adapters.available() if self.runner.adapters is not None else []
        raise TypeError(f"not an engine call: {call!r}")

    async def answer_async(self, call: EngineCall) -> Any:
        """`answer` off the event loop (KV calls wait for the scheduler thread)."""
        return await asyncio.to_thread(self.answer, call)

    @property
    def healthy(self) -> bool:
        """False once the scheduler has stopped or its steps keep failing: the host should replace this engine."""
        return self.loop.healthy

    # -- the convenience API ------------------------------------------------------------------
    def generate(self, prompt: Prompt | Sequence[Prompt], stream: bool = False, **params: Any):
        """`str -> str`, `list -> list[str]`; with `stream=True`, deltas (`str`, or `(index, str)` for a list)."""
        if _is_batch(prompt):
            requests = [GenerateRequest(prompt=p, **params) for p in prompt]
        else:
            requests = GenerateRequest(prompt=prompt, **params)
        return self.generate_with_request(requests, stream=stream)

    def generate_with_request(self, request: GenerateRequest | Sequence[GenerateRequest], stream: bool = False):
        """As `generate`, for ready-made requests (chat messages too)."""
        if isinstance(request, GenerateRequest):
            result = self.submit(request)
            return _text_stream(result) if stream else _text_of(result)
        results = self._submit_all(request)
        if stream:
            return _indexed_stream(results, self.abort)
        return [_text_of(r) for r in results]

    def _submit_all(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        results: list[GenerateResult] = []
        try:
            for request in requests:
                results.append(self.submit(request))
        except Exception:
            for result in results:
                self.abort(result.task_id)
            raise
        return results

    async def generate_async(self, prompt: Prompt | GenerateRequest, **params: Any) -> AsyncIterator[str]:
        """Text deltas for one request, for asyncio callers."""
        request = prompt if isinstance(prompt, GenerateRequest) else GenerateRequest(prompt=prompt, **params)
        result = self.submit(request)
        async for delta in result.astream():
            if delta.text:
                yield delta.text

    # -- cached KV (the KV SDK) -------------------------------------------------------------------
    def kv_config(self) -> KVConfig:
        """Page size, KV geometry and dtype, and the RoPE settings K was rotated with."""
        transfer = self._kv_transfer()
        shape = self.runner.kv_shape
        rope_type, theta, inv_freq = self.runner.rotary()
        return KVConfig(
            page_size=transfer.page_size,
            n_layers=shape.n_layers,
            n_kv_heads=shape.n_kv_heads,
            head_dim=shape.head_dim,
            dtype=str(shape.dtype).removeprefix("torch."),
            rope_type=rope_type,
            rope_theta=theta,
            rotary_dim=2 * len(inv_freq),
            rope_inv_freq=tuple(inv_freq.tolist()),
        )

    def kv_lookup(self, tokens: Sequence[int], cache_salt: str = "") -> int:
        """How many leading tokens of `tokens`, in whole pages, are in the prefix cache."""
        transfer, ids = self._kv_transfer(), _token_list(tokens)
        return self.loop.call(lambda: transfer.lookup(ids, cache_salt))

    def kv_locate(self, tokens: Sequence[int], cache_salt: str = "") -> list[str]:
        """The tier holding each leading whole page of `tokens` held anywhere: "pool" (the engine's own
        pages), then "host", "disk" or "cluster" for the pages that continue beyond the pool."""
        transfer, ids = self._kv_transfer(), _token_list(tokens)
        in_pool = self.loop.call(lambda: transfer.lookup(ids, cache_salt)) // transfer.page_size
        where = ["pool"] * in_pool
        if self.tiers is not None:
            where += self.tiers.where(list(page_hashes(ids, transfer.page_size, cache_salt))[in_pool:])
        return where

    def kv_retrieve(self, tokens: Sequence[int], cache_salt: str = "") -> torch.Tensor | None:
        """`[2, n_layers, T, n_kv_heads * head_dim]` for the longest cached whole-page prefix; None under a page."""
        transfer, ids = self._kv_transfer(), _token_list(tokens)
        return self.loop.call(lambda: transfer.retrieve(ids, cache_salt))

    def kv_store(self, kv: torch.Tensor, tokens: Sequence[int], cache_salt: str = "") -> bool:
        """Cache `kv` as the KV of `tokens` (whole pages); False when every page was cached already."""
        return self.kv_store_pages(kv, tokens, cache_salt).stored_pages > 0

    def kv_store_pages(self, kv: torch.Tensor, tokens: Sequence[int], cache_salt: str = "") -> StoreResult:
        """As `kv_store`, answering how many pages were stored and how many were already cached."""
        transfer, ids = self._kv_transfer(), _token_list(tokens)
        transfer.check(kv, ids)
        return self.loop.call(lambda: transfer.store(kv, ids, cache_salt))

    def _kv_transfer(self) -> KVTransfer:
        if self._transfer is None:
            raise InvalidRequestError("kv_cache", "cached KV needs the paged cache with prefix caching on")
        return self._transfer

    # -- state --------------------------------------------------------------------------------
    def get_stats(self) -> dict[str, int]:
        stats = self.scheduler.stats
        return {**self._counters(stats), **self._tier_stats(stats), **self._speculation_stats(), **self._compile_stats()}

    def _compile_stats(self) -> dict[str, int]:
        """Whether steps run the compiled forward, and its graphs this start loaded from torch's compile
        caches or compiled."""
        compiled = self.runner.compiled
        return {
            "compiled_forward": int(compiled is not None),
            "compile_graphs_loaded": compiled.counts.fx_graph_hits if compiled is not None else 0,
            "compile_graphs_compiled": compiled.counts.fx_graph_misses if compiled is not None else 0,
        }

    def _counters(self, stats: SchedulerStats) -> dict[str, int]:
        running, waiting = self.loop.counts()
        usage = self.cache.usage()
        adapters = self.runner.adapters
        return {
            "total_tasks": stats.total_tasks,
            "total_tokens": stats.total_tokens,
            "active_tasks": running,
            "waiting_queue": waiting,
            "kv_pages_total": usage.total,
            "kv_pages_free": usage.free,
            "prefix_cache_queried_tokens": stats.prefix_cache_queried_tokens,
            "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
            "prompt_tokens": stats.prompt_tokens,
            "prefill_tokens": stats.prefill_tokens,
            "preemptions": stats.preemptions,
            "steps": stats.steps,
            "lora_adapters_loaded": len(adapters.loaded()) if adapters is not None else 0,
            "lora_adapter_loads": adapters.loads if adapters is not None else 0,
        }

    def _speculation_stats(self) -> dict[str, int]:
        """Speculative decoding's counts (`SpeculationStats`), as `spec_decode_*`; zero when it is off."""
        speculator = self.scheduler.speculator
        stats = speculator.stats if speculator is not None else SpeculationStats()
        return {f"spec_decode_{name}": value for name, value in asdict(stats).items()}

    def _tier_stats(self, stats: SchedulerStats) -> dict[str, int]:
        """Prefix-cache hits by tier (`prefix_cache_hit_tokens_pool`, `_host`, `_disk`, `_cluster`), and with
        tiers each one's bytes, pages, evictions (and the disk's corrupt pages found)."""
        loading = self.scheduler.tiers
        by_tier = dict(loading.hit_tokens) if loading is not None else dict.fromkeys(TIER_NAMES, 0)
        out = {"prefix_cache_hit_tokens_pool": stats.prefix_cache_hit_tokens - sum(by_tier.values())}
        out |= {f"prefix_cache_hit_tokens_{tier}": tokens for tier, tokens in by_tier.items()}
        if self.tiers is not None:
            for tier, usage in self.tiers.usage().items():
                out |= {f"kv_tier_{tier}_bytes": usage.bytes, f"kv_tier_{tier}_pages": usage.pages,
                        f"kv_tier_{tier}_evictions": usage.evictions}
                if tier == "disk":
                    out["kv_tier_disk_corrupt_pages"] = usage.corrupt
            out |= {"kv_tier_writes_queued_bytes": self.tiers.queued_bytes, "kv_tier_writes_dropped": self.tiers.writes_dropped,
                    "kv_tier_load_failures": self.tiers.load_failures}
        return out

    def shutdown(self) -> None:
        """Stop the scheduler thread; unfinished requests end as cancelled."""
        if self._activity is not None:
            self._activity.stop()
        self.loop.stop()
        if self.tiers is not None:
            self.tiers.close()


def _token_list(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        return [int(t) for t in tokens.reshape(-1).tolist()]
    if isinstance(tokens, str) or not all(isinstance(t, int) for t in tokens):
        raise InvalidRequestError("tokens", "expected a list of token ids")
    return list(tokens)


def _is_batch(prompt: Any) -> bool:
    """A list of prompts, as opposed to one prompt given as a list of token ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and not isinstance(prompt[0], int)


def _text_stream(result: GenerateResult) -> Iterator[str]:
    for delta in result.stream():
        if delta.text:
            yield delta.text
    _raise_on_error(result)


def _indexed_stream(results: list[GenerateResult], abort: Callable[[int], None]) -> Iterator[tuple[int, str]]:
    """Deltas of several requests as they arrive, each tagged with its request's index."""
    events: queue.SimpleQueue[tuple[int, StreamDelta]] = queue.SimpleQueue()
    for index, result in enumerate(results):
        result.subscribe(lambda delta, index=index: events.put((index, delta)))
    remaining = len(results)
    try:
        while remaining:
            index, delta = events.get()
            if delta.text:
                yield index, delta.text
            if delta.finish_reason is not None:
                remaining -= 1
    finally:
        for result in results:
            if not result.finished:
                abort(result.task_id)
    for result in results:
        _raise_on_error(result)


def _text_of(result: GenerateResult) -> str:
    _raise_on_error(result.wait())
    return result.text


def _raise_on_error(result: GenerateResult) -> None:
    if result.finish_reason == "error":
        raise RuntimeError(result.error or f"task {result.task_id} failed")
