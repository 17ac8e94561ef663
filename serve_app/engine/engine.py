"""InferenceEngine: the engine core in this process -- the model runner, the KV cache and the scheduler thread --
reached as a `CoreClient` (`add_request`), with the conveniences of callers in process (`submit`, `generate`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from serve_app.config import EngineConfig
from serve_app.engine.activity_log import ActivityLog, log_start
from serve_app.engine.cached_kv import CachedKV
from serve_app.engine.conveniences import Conveniences
from serve_app.engine.delta_stream import DeltaListener, DeltaStream
from serve_app.engine.freed_memory import give_back_freed_memory
from serve_app.engine.grammar import GrammarCompiler
from serve_app.engine.intake import TaskIntake, reasoning_markers, reasoning_parser
from serve_app.engine.loop import EngineLoop
from serve_app.engine.output_processor import OutputProcessor
from serve_app.engine.scheduler import Scheduler
from serve_app.engine.speculation import Speculator
from serve_app.engine.stats import engine_stats
from serve_app.engine.step import ModelStep
from serve_app.engine.task import Task
from serve_app.engine.task_output import OutputSink
from serve_app.engine.tier_loading import TierLoading
from serve_app.kv.base import KVCache
from serve_app.kv.factory import build_kv_cache
from serve_app.kv.page_cache import PageCache
from serve_app.kv.tiers.layout import layout_key
from serve_app.kv.tiers.tier_chain import RayTiers, TierChain
from serve_app.kv.transfer import KVTransfer
from serve_app.model.runner import ModelRunner
from serve_app.model.tokenizer import Tokenizer
from serve_app.wire.calls import EngineCall, GetKVConfig, GetStats, ListAdapters, LookupKV, RetrieveKV, StoreKV
from serve_app.wire.model_card import ToolFormat
from serve_app.wire.page_events import PageEventLog
from serve_app.wire.requests import EncodedRequest, GenerateRequest

logger = logging.getLogger(__name__)

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


class InferenceEngine(Conveniences):
    """Loads a model and serves generation requests from a continuous-batching scheduler thread.

    `InferenceEngine(model="smollm2-135m-instruct", kv_cache="paged")`; further options are the
    flat keys of `EngineConfig.from_options` (`page_size`, `cache_tokens`, `max_num_seqs`, ...).
    `ray_tiers` builds the KV tiers kept in a Ray cluster, for a config that names them.
    """

    def __init__(
        self,
        model: str | None = None,
        kv_cache: str | None = None,
        *,
        config: EngineConfig | None = None,
        ray_tiers: RayTiers | None = None,
        **options: Any,
    ) -> None:
        if model is not None:
            options["model"] = model
        if kv_cache is not None:
            options["kv_cache"] = kv_cache
        self.config = (config or EngineConfig()).with_options(**options)
        self._ray_tiers = ray_tiers
        logging.getLogger("serve_app").setLevel(self.config.logging.log_level.upper())
        self.runner, self.cache = _on_a_thread_of_its_own(self._load)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.hidden_size = self.runner.hidden_size
        chosen = self.config.model.tool_call_format
        self.tool_format: ToolFormat = self.tokenizer.tool_format if chosen == "auto" else chosen
        self.reasoning_parser = reasoning_parser(self.config.model.reasoning_parser, self.tool_format)
        self.reasoning_markers = reasoning_markers(self.reasoning_parser, self.tokenizer)
        self.grammars = GrammarCompiler(
            self.tokenizer, self.runner.vocab_size, self.tokenizer.eos_token_ids, self.config.grammar,
            harmony=self.reasoning_parser == "openai_gptoss",
        )
        speculative = self.config.speculative
        self.scheduler = Scheduler(
            self.cache, self.config.scheduler, self.max_model_len, Speculator(speculative) if speculative is not None else None
        )
        self.loop = EngineLoop(self.scheduler, ModelStep(self.runner, self.scheduler, self.grammars))
        self.intake = TaskIntake(
            self.runner, self.cache, self.grammars, self.reasoning_markers, self.config.scheduler.scheduling_policy
        )
        self.tiers = self._start_tiers()  # None without kv_tiers
        transfer = (
            KVTransfer(self.cache, self.runner.vocab_size)
            if isinstance(self.cache, PageCache) and self.cache.enable_prefix_caching
            else None
        )
        self.kv = CachedKV(transfer, self.runner, self.loop, self.tiers)  # the KV SDK's calls
        self._task_ids = itertools.count(1)
        self.created = int(time.time())
        self.loop.start()
        log_start(self)
        interval = self.config.logging.log_stats_interval_s
        self._activity = ActivityLog(self.get_stats, interval) if interval > 0 else None

    def _load(self) -> tuple[ModelRunner, KVCache]:
        runner = ModelRunner(self.config.model, self.config.cache.kv_cache_dtype)
        scheduler = self.config.scheduler
        activations = runner.activation_bytes(scheduler.max_num_batched_tokens, self._max_sampled_rows())
        cache = build_kv_cache(self.config.cache, runner.kv_shape, runner.max_model_len, runner.device, activations)
        if self.config.model.compile:
            runner.compile(cache.storage)
        give_back_freed_memory()  # what loading and compiling freed
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
        layout = layout_key(self.runner.path, config.model.cache_dir, self.runner.quantization, self.cache.page_size,
                            self.runner.kv_shape)
        page_bytes = self.runner.kv_shape.bytes_per_token * self.cache.page_size
        chain = TierChain(config.tiers, layout, page_bytes, self.loop.deliver_loaded, self._ray_tiers)
        self.cache.pool.record_published()
        self.scheduler.tiers = TierLoading(self.cache, chain)
        logger.info("KV tiers behind the pool: %s", ", ".join(source.name for source in chain.sources))
        return chain

    @property
    def tokenizer(self) -> Tokenizer:
        return self.runner.tokenizer

    # -- submitting ---------------------------------------------------------------------------
    def encode(self, request: GenerateRequest) -> EncodedRequest:
        """A request asked in process, as the engine runs it: its prompt's ids by this engine's tokenizer, its own
        `client_salt` as the tenant salt. (A server encodes where its HTTP layer runs, with the tenant's salt.)"""
        ids = self.tokenizer.prompt_ids(request)
        return EncodedRequest(request, ids, request.client_salt or "", pin_tokens=self.tokenizer.cached_prefix_length(request, ids))

    def submit(self, request: GenerateRequest, listener: DeltaListener | None = None) -> DeltaStream:
        """Encode a request here and queue it (`add_request`)."""
        return self.add_request(self.encode(request), listener)

    def add_request(
        self, request: EncodedRequest, listener: DeltaListener | None = None, withdrawn: Callable[[], bool] = lambda: False
    ) -> DeltaStream:
        """Check an encoded request and queue it; its deltas come through the stream returned (`listener` sees each
        as it is published, on the scheduler thread). Raises what `queue` raises, before queueing anything."""
        stream = DeltaStream(OutputProcessor(self.tokenizer, request), self.abort, listener)
        stream.accepted(self.queue(request, lambda _, output: stream.put(output), withdrawn).task_id)
        return stream

    def queue(self, request: EncodedRequest, out: OutputSink, withdrawn: Callable[[], bool] = lambda: False) -> Task:
        """Check a request and queue it, its outputs to go to `out` (on the scheduler thread). Raises
        InvalidRequestError for a request the engine will not run, EngineOverloadedError when too many wait, and
        CompileAbandoned when `withdrawn()` turns true while its grammar compiles."""
        task = self.intake.task(request, next(self._task_ids), out, withdrawn)
        try:
            self.loop.submit(task)
        except BaseException:
            task.release()
            raise
        return task

    async def add_request_async(self, request: EncodedRequest) -> DeltaStream:
        """`add_request` off the event loop (it compiles grammars). A caller cancelled meanwhile leaves nothing
        running."""
        gone = threading.Event()

        def add() -> DeltaStream:
            stream = self.add_request(request, withdrawn=gone.is_set)
            if gone.is_set():
                stream.close()
            return stream

        adding = asyncio.ensure_future(asyncio.to_thread(add))
        try:
            return await asyncio.shield(adding)
        except asyncio.CancelledError:
            gone.set()
            adding.add_done_callback(self._abort_added)
            raise

    def _abort_added(self, adding: asyncio.Future) -> None:
        """An add whose caller left after it began: abort what it queued (a second abort is harmless)."""
        if not adding.cancelled() and adding.exception() is None:
            adding.result().close()

    def record_page_events(self) -> PageEventLog | None:
        """Log the page hashes the prefix cache publishes and drops (None without one). Drain the log on
        the scheduler thread (a step listener): the cache changes there."""
        if not self.kv.enabled:
            return None
        assert isinstance(self.cache, PageCache)
        return self.cache.pool.prefix_cache.record_events()

    def abort(self, task_id: int) -> None:
        """Cancel a task; its cache is freed at the next step."""
        self.loop.abort(task_id)

    def answer(self, call: EngineCall) -> Any:
        """What `call` asks of the engine (see the calls in `serve_app.wire.calls`); raises what the engine refuses."""
        match call:
            case GetStats():
                return self.get_stats()
            case GetKVConfig():
                return self.kv.config()
            case LookupKV(tokens, tenant_salt):
                return self.kv.find(tokens, tenant_salt)
            case RetrieveKV(tokens, tenant_salt):
                return self.kv.retrieve(tokens, tenant_salt)
            case StoreKV(kv, tokens, tenant_salt):
                return self.kv.store_pages(kv, tokens, tenant_salt)
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

    # -- state --------------------------------------------------------------------------------
    def get_stats(self) -> dict[str, int]:
        return engine_stats(self)

    def shutdown(self) -> None:
        """Stop the scheduler thread; unfinished requests end as cancelled."""
        if self._activity is not None:
            self._activity.stop()
        self.loop.stop()
        self.grammars.shutdown()
        if self.tiers is not None:
            self.tiers.close()

