"""The HTTP API as a FastAPI app: OpenAI and Anthropic routes, models, health, stats and metrics.

The app reads its `ServerContext` (engine client, limits, metrics) from `app.state.context`, so
the same routes serve behind the Ray Serve ingress and in process.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from serve_app.config import ServerConfig
from serve_app.metrics import CONTENT_TYPE, ServerMetrics
from serve_app.protocols.anthropic import CountTokensRequest, MessagesBuilder, parse
from serve_app.protocols.base import EngineClient, ProtocolHandler, ResponseBuilder
from serve_app.protocols.errors import ProtocolError, invalid
from serve_app.protocols.kv import MEDIA_TYPE as KV_MEDIA_TYPE
from serve_app.protocols.kv import decode_kv, encode_kv, parse_tokens_request
from serve_app.protocols.openai import ChatCompletionsBuilder, CompletionsBuilder
from serve_app.protocols.limits import RequestLimits
from serve_app.request import GenerateRequest
from serve_app.tenants import Tenant, TenantDirectory, TenantSlots, check_client_salt

logger = logging.getLogger(__name__)


@dataclass
class ServerContext:
    engine: EngineClient
    config: ServerConfig = field(default_factory=ServerConfig)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    tenants: TenantDirectory = field(default_factory=TenantDirectory.open)
    slots: TenantSlots = field(init=False)
    limits: RequestLimits = field(init=False)

    def __post_init__(self) -> None:
        self.slots = TenantSlots(self.config.max_concurrent_per_tenant)
        self.limits = RequestLimits.from_config(self.config)

    def caller(self, request: Request, admin: bool = False) -> Tenant:
        """Who sent `request` (`Authorization: Bearer <key>` or `x-api-key`): 401 when unknown, 403 when not admin."""
        key = request.headers.get("x-api-key")
        authorization = request.headers.get("authorization", "")
        if key is None and authorization.lower().startswith("bearer "):
            key = authorization[7:].strip()
        tenant = self.tenants.authenticate(key)
        if tenant is None:
            raise ProtocolError("authentication", "a valid API key is required (Authorization: Bearer or x-api-key)")
        if admin and not tenant.is_admin:
            raise ProtocolError("permission", "this route needs an admin API key")
        return tenant

    def engine_salt(self, tenant: Tenant, client_salt: str) -> str:
        """The engine's cache salt for a caller's request: the only way a salt reaches the engine."""
        if client_salt:
            try:
                check_client_salt(client_salt)
            except ValueError as error:
                raise invalid(f"cache_salt: {error}", "cache_salt") from None
        return self.tenants.cache_salt(tenant, client_salt)


async def read_body(request: Request, limit: int, limit_name: str = "max_request_bytes") -> bytes:
    """The request body: 413 past `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProtocolError("too_large", f"request body is over {limit_name}={limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ProtocolError("too_large", f"request body is over {limit_name}={limit}")
    return bytes(body)


async def read_json(request: Request, limit: int) -> Any:
    """The request body as JSON: 413 past `limit` bytes, 400 when it is not JSON."""
    body = await read_body(request, limit)
    try:
        return json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise invalid("request body is not valid UTF-8") from None
    except json.JSONDecodeError as error:
        raise invalid(f"malformed JSON: {error.msg} at position {error.pos}") from None
    except RecursionError:
        raise invalid("malformed JSON: nested too deeply") from None


def _released_after(response: Response, release: Callable[[], None]) -> Response:
    """`response`, calling `release` once it has been sent (a stream: when it ends or the client leaves)."""
    if not isinstance(response, StreamingResponse):
        release()
        return response
    body = response.body_iterator

    async def releasing() -> AsyncIterator[Any]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            release()

    response.body_iterator = releasing()
    return response


def create_api(context: ServerContext | None = None) -> FastAPI:
    api = FastAPI(title="serve-app", description="OpenAI and Anthropic compatible LLM inference")
    if context is not None:
        api.state.context = context
    chat, completions, messages = ChatCompletionsBuilder(), CompletionsBuilder(), MessagesBuilder()

    def ctx(request: Request) -> ServerContext:
        return request.app.state.context

    async def ready_engine(request: Request, admin: bool = False) -> tuple[EngineClient, Tenant]:
        """The engine once it is ready, and the authenticated caller."""
        tenant = ctx(request).caller(request, admin)
        engine = ctx(request).engine
        if not await engine.ready():
            raise ProtocolError("not_ready", "Engine not initialized")
        return engine, tenant

    async def guarded(builder: ResponseBuilder, work: Callable[[], Awaitable[Response]]) -> Response:
        try:
            return await work()
        except ProtocolError as error:
            return builder.error_response(error)
        except Exception:  # a server fault, never a client's: answer in the protocol's shape
            logger.exception("request failed")
            return builder.error_response(ProtocolError("internal", "internal server error"))

    def generation_route(builder: ResponseBuilder) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            async def work() -> Response:
                context = ctx(request)
                tenant = context.caller(request)
                body = await read_json(request, context.config.max_request_bytes)
                if not context.slots.try_take(tenant):
                    limit = context.config.max_concurrent_per_tenant
                    raise ProtocolError("rate_limit", f"over max_concurrent_per_tenant={limit} requests in flight")
                handler = ProtocolHandler(builder, context.engine, context.metrics)
                try:
                    response = await handler.handle(body, lambda salt: context.engine_salt(tenant, salt), context.limits)
                except BaseException:
                    context.slots.give_back(tenant)
                    raise
                return _released_after(response, lambda: context.slots.give_back(tenant))

            return await guarded(builder, work)

        return route

    api.add_api_route("/v1/chat/completions", generation_route(chat), methods=["POST"])
    api.add_api_route("/v1/completions", generation_route(completions), methods=["POST"])
    api.add_api_route("/v1/messages", generation_route(messages), methods=["POST"])

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        async def work() -> Response:
            engine, _ = await ready_engine(request)
            body = await read_json(request, ctx(request).config.max_request_bytes)
            req: CountTokensRequest = parse(CountTokensRequest, body, await engine.model_info())
            count = await engine.count_tokens(GenerateRequest(messages=req.chat(), max_tokens=None))
            return JSONResponse({"input_tokens": count})

        return await guarded(messages, work)

    @api.get("/v1/models")
    async def models(request: Request) -> Response:
        async def work() -> Response:
            engine, _ = await ready_engine(request)
            info = await engine.model_info()
            card = {
                "id": info.id,
                "object": "model",
                "created": info.created,
                "owned_by": "serve-app",
                "max_model_len": info.max_model_len,
            }
            return JSONResponse({"object": "list", "data": [card]})

        return await guarded(chat, work)

    async def tokens_request(request: Request) -> tuple[EngineClient, list[int], str]:
        context = ctx(request)
        engine, tenant = await ready_engine(request, admin=True)
        req = parse_tokens_request(await read_json(request, context.config.max_request_bytes))
        return engine, req.tokens, context.engine_salt(tenant, req.cache_salt)

    @api.get("/v1/kv/config")
    async def kv_config(request: Request) -> Response:
        async def work() -> Response:
            engine, _ = await ready_engine(request, admin=True)
            return JSONResponse(await engine.kv_config())

        return await guarded(chat, work)

    @api.post("/v1/kv/lookup")
    async def kv_lookup(request: Request) -> Response:
        async def work() -> Response:
            engine, tokens, salt = await tokens_request(request)
            return JSONResponse({"cached_tokens": await engine.kv_lookup(tokens, salt)})

        return await guarded(chat, work)

    @api.post("/v1/kv/retrieve")
    async def kv_retrieve(request: Request) -> Response:
        async def work() -> Response:
            engine, tokens, salt = await tokens_request(request)
            kv = await engine.kv_retrieve(tokens, salt)
            if kv is None:
                raise ProtocolError("not_found", "no whole chunk of these tokens is cached under this salt", "tokens")
            return Response(encode_kv(kv), media_type=KV_MEDIA_TYPE, headers={"x-cached-tokens": str(kv.shape[2])})

        return await guarded(chat, work)

    @api.post("/v1/kv/store")
    async def kv_store(request: Request) -> Response:
        async def work() -> Response:
            context = ctx(request)
            engine, tenant = await ready_engine(request, admin=True)
            kv, tokens, cache_salt = decode_kv(await read_body(request, context.config.max_kv_bytes, "max_kv_bytes"))
            if tokens is None:
                raise invalid("body: the safetensors file has no tensor named 'tokens'", "tokens")
            result = await engine.kv_store(kv, tokens, context.engine_salt(tenant, cache_salt))
            return JSONResponse(
                {
                    "stored": result.stored_chunks > 0,
                    "stored_chunks": result.stored_chunks,
                    "deduplicated_chunks": result.deduplicated_chunks,
                }
            )

        return await guarded(chat, work)

    @api.get("/health")
    async def health(request: Request) -> Response:
        if await ctx(request).engine.ready():
            return JSONResponse({"status": "ok", "model_loaded": True})
        return JSONResponse({"status": "loading", "model_loaded": False}, status_code=503)

    @api.get("/stats")
    async def stats(request: Request) -> Response:
        async def work() -> Response:
            ctx(request).caller(request, admin=True)
            return JSONResponse(await ctx(request).engine.stats())

        return await guarded(chat, work)

    @api.get("/metrics")
    async def metrics(request: Request) -> Response:
        async def work() -> Response:
            context = ctx(request)
            context.caller(request, admin=True)
            return Response(context.metrics.render(await context.engine.stats()), media_type=CONTENT_TYPE)

        return await guarded(chat, work)

    return api

