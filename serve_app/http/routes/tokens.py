"""vLLM's token routes: `/tokenize` (a prompt or chat messages to token ids, with the template applied as the chat
route applies it) and `/detokenize` (token ids to text). Each takes one of the tenant's slots, its text bounded first."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from serve_app.http.context import context_of
from serve_app.http.protocols.errors import invalid
from serve_app.http.protocols.fields import validate_body
from serve_app.http.protocols.openai import ERRORS
from serve_app.http.protocols.tokenize import DetokenizeRequest, TokenizeChat, tokenize_request
from serve_app.http.routes.answering import answers_in
from serve_app.http.served_models import adapter_of

router = APIRouter()


@router.post("/tokenize")
@answers_in(ERRORS)
async def tokenize(request: Request) -> Response:
    context = context_of(request)
    tenant, body, engine, model = await context.model_call(request)
    asked, rendered = tokenize_request(body, model.tool_format, context.limits.unknown_fields)
    if asked.model is not None:
        adapter_of(model, asked.model)
    context.limits.check_characters(rendered, model)
    chat = isinstance(asked, TokenizeChat)
    with context.slot(tenant):
        ids = await engine.prompts.tokenize(
            rendered, add_generation_prompt=chat and asked.add_generation_prompt, add_special_tokens=asked.add_special_tokens
        )
        strings = await engine.prompts.token_strings(ids) if asked.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strings})


@router.post("/detokenize")
@answers_in(ERRORS)
async def detokenize(request: Request) -> Response:
    context = context_of(request)
    tenant, body, engine, model = await context.model_call(request)
    asked = validate_body(DetokenizeRequest, body, context.limits.unknown_fields)
    if asked.model is not None:
        adapter_of(model, asked.model)
    bad = next((token for token in asked.tokens if not 0 <= token < model.vocab_size), None)
    if bad is not None:
        raise invalid(f"tokens: token id {bad} is outside the vocabulary (0..{model.vocab_size - 1})", "tokens")
    if len(asked.tokens) > model.max_model_len:
        raise invalid(f"tokens: {len(asked.tokens)} are over the model's context of {model.max_model_len}", "tokens")
    with context.slot(tenant):
        text = await engine.prompts.detokenize(asked.tokens)
    return JSONResponse({"prompt": text})
