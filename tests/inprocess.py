"""The HTTP app served in process by uvicorn on a loopback port, for fast protocol tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import anthropic
import openai

from serve_app.bench.servers import free_port
from serve_app.config import ServerConfig
from serve_app.engine.engine import InferenceEngine
from serve_app.batch.service import BatchService
from serve_app.http.app import create_api
from serve_app.http.context import ServerContext
from serve_app.http.engine_client import LocalEngineClient, model_card
from serve_app.http.served_models import ServedModels
from serve_app.http.tenants import TenantDirectory

MODEL = "smollm2-135m-instruct"


class InProcessServer:
    """An ASGI app served by uvicorn on a loopback port, in a background thread."""

    def __init__(self, app) -> None:
        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    @property
    def context(self) -> ServerContext:
        return self.app.state.context

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def openai_client(url: str, api_key: str = "unused") -> openai.OpenAI:
    """The official OpenAI SDK against a server of ours: no retries, a generous timeout."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=120)


def anthropic_client(url: str, api_key: str = "unused") -> anthropic.Anthropic:
    """The official Anthropic SDK against a server of ours: no retries, a generous timeout."""
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=120)


@contextmanager
def engine_server(
    engine: InferenceEngine,
    config: ServerConfig | None = None,
    tenants: TenantDirectory | None = None,
    client: type[LocalEngineClient] = LocalEngineClient,
) -> Iterator[InProcessServer]:
    """The server's HTTP app over an in-process engine (served as MODEL), stopped on leaving."""
    context = ServerContext(ServedModels({MODEL: client(engine, model_card(engine, MODEL, engine.config.grammar))}), config or ServerConfig())
    if tenants is not None:
        context.tenants = tenants
    context.batches = BatchService.serving(context)
    server = InProcessServer(create_api(context))
    try:
        yield server
    finally:
        server.stop()
