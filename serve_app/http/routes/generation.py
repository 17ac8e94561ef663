"""The generation routes: OpenAI chat and legacy completions, embeddings, Anthropic messages and token counting."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from serve_app.http.body import read_json
from serve_app.http.context import ServerContext, context_of
from serve_app.http.protocols.anthropic import (
    CountTokensRequest,
    MessagesBuilder,
    parse,
)
from serve_app.http.protocols.base import Answered, ProtocolHandler, ResponseBuilder
from serve_app.http.protocols.openai import ChatCompletionsBuilder, CompletionsBuilder
from serve_app.http.protocols.openai.embeddings import EmbeddingsBuilder
from serve_app.http.routes.answering import answers_in
from serve_app.http.streaming import ClosingStreamingResponse
from serve_app.http.tenants import Tenant
from serve_app.http.tools import format_for
from serve_app.wire.requests import GenerateRequest

router = APIRouter()
messages = MessagesBuilder()


def _generation(builder: ResponseBuilder) -> Callable[[Request], Awaitable[Response]]:
    """A route that runs one request through `builder`."""

    @answers_in(builder.errors)
    async def route(request: Request) -> Response:
        context = context_of(request)
        tenant = context.caller(request)
        body = await read_json(request, context.config.max_request_bytes)
        return await generate(context, tenant, builder, body)

    return route


async def generate(
    context: ServerContext, tenant: Tenant, builder: ResponseBuilder, body: Any, answered: Answered | None = None
) -> Response:
    """Run one request through `builder`, holding one of the tenant's slots until it is over; `answered` runs
    once the answer is whole, before the client has all of it."""
    context.take_slot(tenant)
    try:
        handler = ProtocolHandler(builder, context.models.client_of(body), context.metrics)
        response = await handler.handle(body, lambda salt: context.tenant_salt(tenant, salt), context.limits, answered)
    except BaseException:
        context.slots.give_back(tenant)
        raise
    if isinstance(response, ClosingStreamingResponse):
        response.call_on_close(lambda: context.slots.give_back(tenant))
        return response
    context.slots.give_back(tenant)
    return response


router.add_api_route("/v1/chat/completions", _generation(ChatCompletionsBuilder()), methods=["POST"])
router.add_api_route("/v1/completions", _generation(CompletionsBuilder()), methods=["POST"])
router.add_api_route("/v1/messages", _generation(messages), methods=["POST"])
router.add_api_route("/v1/embeddings", _generation(EmbeddingsBuilder()), methods=["POST"])


@router.post("/v1/messages/count_tokens")
@answers_in(messages.errors)
async def count_tokens(request: Request) -> Response:
    """Tokenizing is work like a generation's: it takes one of the tenant's slots, and its text is bounded first."""
    context = context_of(request)
    tenant, body, engine, model = await context.model_call(request)
    req: CountTokensRequest = parse(CountTokensRequest, body, model, context.limits.unknown_fields)
    prompt = req.prompt(format_for(model.tool_format), req.tool_plan())
    thinking = req.thinking_budget(model)  # the prompt as the message would render it, thinking or not
    counted = GenerateRequest(
        messages=prompt.messages, tools=prompt.tools, max_tokens=None, chat_template_kwargs=thinking.template_kwargs(None)
    )
    context.limits.check_characters(counted, model)
    with context.slot(tenant):
        count = await engine.prompts.count(counted)
    return JSONResponse({"input_tokens": count})
