"""The Responses API routes: `POST /v1/responses` (continuing a stored response with
`previous_response_id`), and `GET` / `DELETE /v1/responses/{id}` on the caller's stored responses."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from serve_app.http.body import read_json
from serve_app.http.context import ServerContext, context_of
from serve_app.http.protocols.base import ResponseFormatter
from serve_app.http.protocols.errors import ProtocolError
from serve_app.http.protocols.responses import ResponsesBuilder, ResponsesFormatter
from serve_app.http.response_store import StoredResponse
from serve_app.http.routes.answering import answers_in
from serve_app.http.routes.generation import generate
from serve_app.http.tenants import Tenant

router = APIRouter()
answers = answers_in(ResponsesBuilder.errors)  # errors in the Responses API's shape (OpenAI's)


@router.post("/v1/responses")
@answers
async def create_response(request: Request) -> Response:
    context = context_of(request)
    tenant = context.caller(request)
    body = await read_json(request, context.config.max_request_bytes)
    previous_id = body.get("previous_response_id") if isinstance(body, dict) else None
    previous = await _stored(context, tenant, previous_id, "previous_response_id") if isinstance(previous_id, str) else None
    keep = not isinstance(body, dict) or body.get("store") is not False

    async def store(answer: ResponseFormatter) -> None:
        assert isinstance(answer, ResponsesFormatter)
        if keep and answer.finished is not None and context.config.max_stored_responses > 0:
            await context.responses.put(tenant.id, answer.finished)

    return await generate(context, tenant, ResponsesBuilder(previous), body, answered=store)


@router.get("/v1/responses/{response_id}")
@answers
async def get_response(request: Request) -> Response:
    context = context_of(request)
    stored = await _stored(context, context.caller(request), request.path_params["response_id"])
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}")
@answers
async def delete_response(request: Request) -> Response:
    context = context_of(request)
    response_id = request.path_params["response_id"]
    if not await context.responses.delete(context.caller(request).id, response_id):
        raise ProtocolError("not_found", f"no response {response_id!r}")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def _stored(context: ServerContext, tenant: Tenant, response_id: str, param: str | None = None) -> StoredResponse:
    """The caller's stored response (404 when it is not there: never kept, expired, or another tenant's)."""
    stored = await context.responses.get(tenant.id, response_id)
    if stored is None:
        raise ProtocolError("not_found", f"{param + ': ' if param else ''}no response {response_id!r}", param)
    return stored
