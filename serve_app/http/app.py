"""create_api(context): the FastAPI app, its routers reading their `ServerContext` from `app.state.context`.

The same app serves behind Ray Serve's ingress (with Ray handles to the engine) and in process.
"""

from __future__ import annotations

from fastapi import FastAPI

from serve_app.http.context import ServerContext
from serve_app.http.routes import admin, batches, generation, kv, responses, tokens, web


def create_api(context: ServerContext | None = None) -> FastAPI:
    api = FastAPI(title="serve-app", description="OpenAI (chat, completions, responses) and Anthropic compatible LLM inference")
    if context is not None:
        api.state.context = context
    for routes in (generation.router, responses.router, batches.router, tokens.router, kv.router, admin.router, web.router):
        api.include_router(routes)
    return api
