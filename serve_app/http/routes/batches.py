"""OpenAI's Batch API routes, per tenant: `/v1/files` (upload with purpose `batch`, list, retrieve, content, delete)
and `/v1/batches` (create, retrieve, list, cancel), answered from the server's `Batches`."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile
from starlette.responses import JSONResponse, Response

from serve_app.http.batches import Batches, StoreError
from serve_app.http.body import read_form, read_json
from serve_app.http.context import ServerContext, context_of
from serve_app.http.protocols.errors import ProtocolError, invalid
from serve_app.http.protocols.openai.builders import ERRORS
from serve_app.http.routes.answering import answers_in

router = APIRouter()
answers = answers_in(ERRORS)

# What a multipart upload may carry besides its file: room for the form's own overhead.
FORM_OVERHEAD_BYTES = 64 * 1024


def batches_of(context: ServerContext) -> Batches:
    """The server's Batch API (404 where it has none)."""
    if context.batches is None:
        raise ProtocolError("not_found", "this server has no Batch API")
    return context.batches


async def stored(call: Awaitable[Any]) -> Any:
    """What the store answers; its refusal as the API's error."""
    try:
        return await call
    except StoreError as error:
        raise ProtocolError(error.kind, error.message, error.param) from None  # type: ignore[arg-type]


def query_int(request: Request, name: str, default: int, most: int) -> int:
    text = request.query_params.get(name)
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise invalid(f"{name}: an integer from 1 to {most}", name)
    return int(text)


def known_query(request: Request, *names: str) -> None:
    unknown = sorted(set(request.query_params) - set(names))
    if unknown:
        raise invalid(f"{unknown[0]}: not a query parameter of this route", unknown[0])


@router.post("/v1/files")
@answers
async def upload_file(request: Request) -> Response:
    context = context_of(request)
    tenant = context.caller(request)
    limit = context.config.max_batch_file_bytes
    form = await read_form(request, limit + FORM_OVERHEAD_BYTES, "max_batch_file_bytes", fields=4)
    unknown = sorted(set(form) - {"file", "purpose"})
    if unknown:
        raise invalid(f"{unknown[0]}: unrecognized field", unknown[0])
    upload, purpose = form.get("file"), form.get("purpose")
    if not isinstance(upload, UploadFile):
        raise invalid("file: a file is required", "file")
    if not isinstance(purpose, str):
        raise invalid("purpose: required (batch)", "purpose")
    data = await upload.read()
    return JSONResponse(await stored(batches_of(context).add_file(tenant.id, upload.filename or "upload", purpose, data)))


@router.get("/v1/files")
@answers
async def list_files(request: Request) -> Response:
    context = context_of(request)
    tenant = context.caller(request)
    known_query(request, "purpose", "limit", "after", "order")
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order: asc or desc", "order")
    page = batches_of(context).files(
        tenant.id, request.query_params.get("purpose"), request.query_params.get("after"),
        query_int(request, "limit", 10_000, 10_000), order,
    )
    return JSONResponse(await stored(page))


def _callers_file(request: Request) -> tuple[Batches, str, str]:
    """The server's Batch API, the caller's tenant and the file the path names."""
    context = context_of(request)
    return batches_of(context), context.caller(request).id, request.path_params["file_id"]


@router.get("/v1/files/{file_id}")
@answers
async def retrieve_file(request: Request) -> Response:
    batches, tenant, file_id = _callers_file(request)
    return JSONResponse(await stored(batches.file(tenant, file_id)))


@router.get("/v1/files/{file_id}/content")
@answers
async def file_content(request: Request) -> Response:
    batches, tenant, file_id = _callers_file(request)
    return Response(await stored(batches.content(tenant, file_id)), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
@answers
async def delete_file(request: Request) -> Response:
    batches, tenant, file_id = _callers_file(request)
    return JSONResponse(await stored(batches.delete_file(tenant, file_id)))


@router.post("/v1/batches")
@answers
async def create_batch(request: Request) -> Response:
    context = context_of(request)
    tenant = context.caller(request)
    body = await read_json(request, context.config.max_request_bytes)
    return JSONResponse(await stored(batches_of(context).create_batch(tenant.id, body)))


@router.get("/v1/batches")
@answers
async def list_batches(request: Request) -> Response:
    context = context_of(request)
    tenant = context.caller(request)
    known_query(request, "limit", "after")
    page = batches_of(context).batches(tenant.id, request.query_params.get("after"), query_int(request, "limit", 20, 100))
    return JSONResponse(await stored(page))


@router.get("/v1/batches/{batch_id}")
@answers
async def get_batch(request: Request) -> Response:
    context = context_of(request)
    return JSONResponse(await stored(batches_of(context).batch(context.caller(request).id, request.path_params["batch_id"])))


@router.post("/v1/batches/{batch_id}/cancel")
@answers
async def cancel_batch(request: Request) -> Response:
    context = context_of(request)
    tenant = context.caller(request)
    return JSONResponse(await stored(batches_of(context).cancel_batch(tenant.id, request.path_params["batch_id"])))
