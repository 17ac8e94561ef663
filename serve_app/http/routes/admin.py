"""The admin routes: health (open to all), the model cards (every model and its LoRA adapters), the
engines' stats and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from serve_app.http.context import context_of
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
@answers
async def models(request: Request) -> Response:
    context = context_of(request)
    await context.ready_caller(request)
    return JSONResponse({"object": "list", "data": await context.models.cards()})


@router.get("/v1/models/{model:path}")
@answers
async def model_card(request: Request) -> Response:
    """One model's or adapter's card (the OpenAI SDK's `models.retrieve`); 404 naming it when none has that id."""
    context = context_of(request)
    await context.ready_caller(request)
    model = request.path_params["model"]
    card = next((card for card in await context.models.cards() if card["id"] == model), None)
    if card is None:
        raise ProtocolError("not_found", f"model: {model!r} is not served here", "model")
    return JSONResponse(card)


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
