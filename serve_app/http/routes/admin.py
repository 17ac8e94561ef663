"""The admin routes: health (open to all), the model cards (every model and its LoRA adapters, in OpenAI's shape or
Anthropic's), the engines' stats and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from serve_app.http.context import context_of
from serve_app.http.protocols.anthropic import ERRORS as ANTHROPIC_ERRORS
from serve_app.http.protocols.anthropic.models import anthropic_card, anthropic_page
from serve_app.http.protocols.errors import ProtocolError
from serve_app.http.protocols.openai import ERRORS
from serve_app.http.routes.answering import answers_in
from serve_app.metrics.prometheus import CONTENT_TYPE

router = APIRouter()
answers = answers_in(ERRORS)  # errors in OpenAI's shape


@router.get("/health")
async def health(request: Request) -> Response:
    if await context_of(request).models.ready():
        return JSONResponse({"status": "ok", "model_loaded": True})
    return JSONResponse({"status": "loading", "model_loaded": False}, status_code=503)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """The model list, in Anthropic's shape when the caller sends `anthropic-version` (Anthropic's SDK does)."""
    if _from_anthropic(request):
        return await _anthropic_models(request)
    return await _openai_models(request)


@answers
async def _openai_models(request: Request) -> Response:
    context = context_of(request)
    await context.ready_caller(request)
    return JSONResponse({"object": "list", "data": await context.models.cards()})


@answers_in(ANTHROPIC_ERRORS)
async def _anthropic_models(request: Request) -> Response:
    context = context_of(request)
    await context.ready_caller(request)
    return JSONResponse(anthropic_page(await context.models.cards(), request.query_params))


@router.get("/v1/models/{model:path}")
async def model_card(request: Request) -> Response:
    """One model's or adapter's card (the SDKs' `models.retrieve`); 404 naming it when none has that id."""
    if _from_anthropic(request):
        return await _anthropic_card(request)
    return await _openai_card(request)


@answers
async def _openai_card(request: Request) -> Response:
    return JSONResponse(await _card(request))


@answers_in(ANTHROPIC_ERRORS)
async def _anthropic_card(request: Request) -> Response:
    return JSONResponse(anthropic_card(await _card(request)))


async def _card(request: Request) -> dict[str, Any]:
    context = context_of(request)
    await context.ready_caller(request)
    model = request.path_params["model"]
    card = next((card for card in await context.models.cards() if card["id"] == model), None)
    if card is None:
        raise ProtocolError("not_found", f"model: {model!r} is not served here", "model")
    return card


def _from_anthropic(request: Request) -> bool:
    return "anthropic-version" in request.headers


@router.get("/stats")
@answers
async def stats(request: Request) -> Response:
    context = context_of(request)
    context.caller(request, admin=True)
    return JSONResponse(await context.models.first.stats())


@router.get("/stats/replicas")
@answers
async def replica_stats(request: Request) -> Response:
    context = context_of(request)
    context.caller(request, admin=True)
    return JSONResponse(await context.models.first.replica_stats())


@router.get("/stats/routing")
@answers
async def routing_stats(request: Request) -> Response:
    context = context_of(request)
    context.caller(request, admin=True)
    return JSONResponse(await context.models.first.routing_stats())


@router.get("/metrics")
@answers
async def metrics(request: Request) -> Response:
    context = context_of(request)
    context.caller(request, admin=True)
    replicas = await context.models.first.replica_stats()  # every engine replica of every model
    return Response(context.metrics.render(replicas), media_type=CONTENT_TYPE)
