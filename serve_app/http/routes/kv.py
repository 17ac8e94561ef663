"""The cached-KV routes (`/v1/kv/*`, admin only): config, lookup, retrieve and store, per tenant salt, on the
model the `?model=` query names (the base model's cache: an adapter's KV is keyed by the adapter too), else
on the app's first."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from serve_app.http.body import check_media_type, read_body, read_json
from serve_app.http.context import context_of
from serve_app.http.engine_client import EngineClient
from serve_app.http.protocols.errors import ProtocolError, invalid
from serve_app.http.protocols.kv import (
    MEDIA_TYPE,
    TokensRequest,
    decode_kv,
    encode_kv,
    parse_tokens_request,
)
from serve_app.http.protocols.openai import ERRORS
from serve_app.http.routes.answering import answers_in
from serve_app.wire.calls import GetKVConfig, LookupKV, RetrieveKV, StoreKV

router = APIRouter(prefix="/v1/kv")
answers = answers_in(ERRORS)  # errors in OpenAI's shape


def _engine(request: Request) -> EngineClient:
    """The engine client of the model the query names; 404 for one not served, 400 for an adapter."""
    model = request.query_params.get("model")
    if model is not None and ":" in model:
        raise invalid(f"model: {model!r} names an adapter; the KV routes reach a model's own cache", "model")
    return context_of(request).models.client_for(model)


async def _tokens_request(request: Request) -> tuple[TokensRequest, str]:
    """The body's tokens, and the tenant salt of the caller's `cache_salt`."""
    context = context_of(request)
    tenant = await context.ready_caller(request, admin=True)
    req = parse_tokens_request(await read_json(request, context.config.max_request_bytes))
    return req, context.tenant_salt(tenant, req.cache_salt or None)  # the KV API's "" is no salt


@router.get("/config")
@answers
async def kv_config(request: Request) -> Response:
    context = context_of(request)
    await context.ready_caller(request, admin=True)
    return JSONResponse((await _engine(request).ask(GetKVConfig())).to_dict())


@router.post("/lookup")
@answers
async def kv_lookup(request: Request) -> Response:
    req, salt = await _tokens_request(request)
    found = await _engine(request).ask(LookupKV(req.tokens, salt))
    return JSONResponse({"cached_tokens": found.cached_tokens, "pages": list(found.pages)})


@router.post("/retrieve")
@answers
async def kv_retrieve(request: Request) -> Response:
    req, salt = await _tokens_request(request)
    kv = await _engine(request).ask(RetrieveKV(req.tokens, salt))
    if kv is None:
        raise ProtocolError("not_found", "no whole page of these tokens is cached under this salt", "tokens")
    return Response(encode_kv(kv), media_type=MEDIA_TYPE, headers={"x-cached-tokens": str(kv.shape[2])})


@router.post("/store")
@answers
async def kv_store(request: Request) -> Response:
    context = context_of(request)
    tenant = await context.ready_caller(request, admin=True)
    check_media_type(request, MEDIA_TYPE)
    kv, tokens, cache_salt = decode_kv(await read_body(request, context.config.max_kv_bytes, "max_kv_bytes"))
    if tokens is None:
        raise invalid("body: the safetensors file has no tensor named 'tokens'", "tokens")
    result = await _engine(request).ask(StoreKV(kv, tokens, context.tenant_salt(tenant, cache_salt or None)))
    return JSONResponse(
        {
            "stored": result.stored_pages > 0,
            "stored_pages": result.stored_pages,
            "deduplicated_pages": result.deduplicated_pages,
        }
    )
