"""EngineDeployment: one model's engine per replica (one deployment per `llm_configs` entry), in its own
process, streaming deltas through an async generator to the ingress, and answering whole OpenAI requests
(`chat`, `completions`) to Ray Data LLM's `ServeDeploymentProcessorConfig`."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.app_args import LLMConfig
from deployments.model_copy import model_here
from deployments.placement import Placement
from deployments.ray_metrics import RayMetrics
from serve_app.batch.answering import answer_request
from serve_app.config import ServerConfig
from serve_app.engine.core_client import answer_or_refusal, open_stream
from serve_app.engine.process import EngineProcess, EngineProcessError
from serve_app.http.engine_client import LocalEngineClient, model_card
from serve_app.http.protocols.limits import RequestLimits
from serve_app.metrics import tracing
from serve_app.metrics.catalog import ENGINE_METRICS, engine_samples
from serve_app.routing.page_reporter import PageReporter
from serve_app.wire.calls import EngineCall
from serve_app.wire.outputs import StreamDelta
from serve_app.wire.page_events import PageEventBatch
from serve_app.wire.refusals import RequestRefused
from serve_app.wire.requests import EncodedRequest

# How often the replica looks for news to report: page events and load changes go out then.
REPORT_EVERY_S = 0.1
# The other stats (token counts and the like) go out with a heartbeat at least this often.
HEARTBEAT_S = 1.0
# How often the engine's state is copied into Ray's metrics (Ray exports them every few seconds).
RAY_METRICS_EVERY_S = 2.0
# The keys Ray Data LLM's serve-deployment stage adds to every request it sends: its bookkeeping, not the API's.
RAY_DATA_KEYS = ("request_id", "idx_in_batch")


@serve.deployment(name="EngineDeployment", max_ongoing_requests=256, logging_config={"enable_access_log": False})
class EngineDeployment:
    """Loads the model in its constructor, so a replica only takes traffic once it can serve it.

    The engine runs in a child process (`EngineProcess`), so its scheduler shares no interpreter
    lock with this replica's event loops and Ray's threads. No method here blocks the replica's
    event loop: every exchange with the engine process is awaited.
    """

    def __init__(
        self, llm: dict[str, Any], board: DeploymentHandle, server: dict[str, Any], traces_endpoint: str | None = None
    ) -> None:
        llm_config = LLMConfig.model_validate(llm)
        tracing.configure(traces_endpoint, "serve-app-engine")
        config = llm_config.engine()  # on this node: its cache folder and device, unless the args set them
        model = config.model
        self.engine = EngineProcess(
            Placement.of_this_actor().apply(config.with_options(model=model_here(model.name, model.cache_dir))),
            child="deployments.engine_child",
        )
        engine = self.engine
        self.info = model_card(engine, llm_config.model_id, config.grammar)
        self._direct = LocalEngineClient(engine, self.info)  # for whole requests, held to the ingress's limits
        self._limits = RequestLimits.from_config(ServerConfig.model_validate(server))
        self._page_size = config.cache.page_size
        self._board = board
        replica = serve.get_replica_context().replica_id
        self._replica_id, self._deployment = replica.unique_id, replica.deployment_id.name
        self._place = {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
        # On the replica's event loop: Serve handles may be called only from a running loop.
        reporter = PageReporter(
            self._latest_stats, self.engine.take_page_events, self._report, self.engine.resend_pages, REPORT_EVERY_S,
            HEARTBEAT_S,
        )
        self._reporter = asyncio.get_running_loop().create_task(reporter.run())
        self._metrics = None  # copying the engine's state into Ray's metrics, where `log_engine_metrics` asks
        if llm_config.log_engine_metrics:
            self._metrics = asyncio.get_running_loop().create_task(self._mirror_metrics(RayMetrics(ENGINE_METRICS, totals=True)))

    async def generate(self, request: EncodedRequest) -> AsyncIterator[StreamDelta | RequestRefused]:
        """The request's deltas, or the one `RequestRefused` it amounts to (a value: an exception raised in a Ray
        stream would reach the ingress wrapped)."""
        try:
            deltas = await open_stream(self.engine, request)
        except RequestRefused as refused:
            yield refused
            return
        span = None
        if request.trace_context:
            span = tracing.tracer().start_span("engine", context=tracing.parent(request.trace_context))
            span.set_attribute("serve_app.replica", self._replica_id)
        tokens = 0
        try:
            async for delta in deltas:
                if span is not None:
                    tokens += len(delta.token_ids)
                    if delta.queue_time_s is not None:
                        span.set_attribute("serve_app.queue_time_s", delta.queue_time_s)
                    if delta.finish_reason is not None:
                        span.set_attribute("gen_ai.response.finish_reasons", [delta.finish_reason])
                yield delta
        finally:
            await deltas.aclose()
            if span is not None:
                span.set_attribute("gen_ai.usage.output_tokens", tokens)
                span.end()

    async def chat(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """An OpenAI chat completion request (a dict, or a pydantic model of one) answered whole, as the one item
        of a stream: Ray Data LLM's `ServeDeploymentProcessorConfig` with method `chat`. A request the API refuses
        raises ValueError with the API's message (Ray Data LLM's row error, with `should_continue_on_error`)."""
        yield await self._answer("/v1/chat/completions", request)

    async def completions(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """An OpenAI completion request answered whole, as `chat` answers a chat."""
        yield await self._answer("/v1/completions", request)

    async def _answer(self, url: str, request: Any) -> dict[str, Any]:
        body = request.model_dump(exclude_unset=True) if isinstance(request, BaseModel) else request
        if isinstance(body, dict):
            body = {key: value for key, value in body.items() if key not in RAY_DATA_KEYS}
            if body.get("stream"):
                raise ValueError("stream: a request through the deployment handle is answered whole; set it false")
        status, answer = await answer_request(url, self._direct, body, self._limits)
        if status != 200:
            raise ValueError(f"{status}: {answer.get('error', {}).get('message', answer)}")
        return answer

    async def ask(self, call: EngineCall) -> Any | RequestRefused:
        """The engine's answer to `call` (stats, cached KV, adapters), or the refusal it amounts to."""
        return await answer_or_refusal(self.engine, call)

    def check_health(self) -> None:
        """Serve replaces a replica whose engine process has exited or whose steps keep failing."""
        if not self.engine.alive:
            raise RuntimeError("the engine process has exited")
        if not self.engine.healthy:
            raise RuntimeError("the engine reports itself unhealthy: its steps keep failing")

    async def _report(self, stats: dict[str, int], pages: PageEventBatch) -> bool:
        return await self._board.report.remote(
            self._deployment, self._replica_id, self._place, stats, self.info, pages, self._page_size
        )

    def _latest_stats(self) -> dict[str, int] | None:
        """The engine's latest stats; None once its process has failed (the health check fails this replica)."""
        try:
            return self.engine.latest_stats
        except EngineProcessError:
            return None

    async def _mirror_metrics(self, ray_metrics: RayMetrics) -> None:
        """Copy the engine's state into Ray's metrics every RAY_METRICS_EVERY_S."""
        while True:
            await asyncio.sleep(RAY_METRICS_EVERY_S)
            stats = self._latest_stats()
            if stats is None:
                return
            ray_metrics.record(engine_samples(stats, self.info.id, self._replica_id))

    def __del__(self) -> None:
        for task in (getattr(self, "_reporter", None), getattr(self, "_metrics", None)):
            if task is not None:
                task.cancel()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

