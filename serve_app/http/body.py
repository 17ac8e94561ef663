"""Reading request bodies: the media type the route takes (415), a byte limit (413), and JSON that is really
JSON (400), parsed off the event loop when it is big, or a multipart form (a file upload). The JSON parser still
holds the GIL while it runs (about 35 ms a megabyte on a slow 2-core host), so `max_request_bytes` bounds how
long the loop can wait for it.

Only `application/json` reaches a JSON route: a browser sends a cross-site POST without asking first only
as a form or `text/plain` (or with no type at all), so such a page cannot drive the server. A form is what a
browser does send across sites, so a form from another origin (its `Origin` header not this host) is refused."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser

from serve_app.http.protocols.errors import ProtocolError, invalid

JSON = "application/json"
FORM = "multipart/form-data"
# Bodies up to this size are parsed on the event loop (well under a millisecond); bigger ones on a thread.
PARSE_ON_LOOP_BYTES = 64 * 1024


def check_media_type(request: Request, expected: str) -> None:
    """415 unless the body's `content-type` is `expected` (parameters such as `charset` allowed)."""
    given = request.headers.get("content-type")
    media_type = (given or "").split(";", 1)[0].strip().lower()
    if media_type != expected:
        said = f"content-type {given!r}" if given else "no content-type"
        raise ProtocolError("unsupported_media_type", f"this route takes {expected} bodies; the request has {said}")


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
    """The request body as JSON: 415 for another media type, 413 past `limit` bytes, 400 when it is not JSON."""
    check_media_type(request, JSON)
    body = await read_body(request, limit)
    if len(body) <= PARSE_ON_LOOP_BYTES:
        return parse_json(body)
    return await asyncio.to_thread(parse_json, body)


def parse_json(body: bytes) -> Any:
    try:
        return json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise invalid("request body is not valid UTF-8") from None
    except json.JSONDecodeError as error:
        raise invalid(f"malformed JSON: {error.msg} at position {error.pos}") from None
    except RecursionError:
        raise invalid("malformed JSON: nested too deeply") from None


async def read_form(request: Request, limit: int, limit_name: str, fields: int) -> FormData:
    """A multipart form (a file upload): 415 for another media type, 413 past `limit` bytes, 400 for more than
    `fields` fields or one file, or a malformed body. It is read whole (within `limit`) before it is parsed."""
    check_media_type(request, FORM)
    origin = request.headers.get("origin")
    if origin is not None and origin.split("://", 1)[-1] != request.headers.get("host"):
        raise ProtocolError("permission", f"a form from another origin ({origin}) is not taken")
    body = await read_body(request, limit, limit_name)

    async def chunks():
        yield body

    parser = MultiPartParser(request.headers, chunks(), max_files=1, max_fields=fields, max_part_size=64 * 1024)
    try:
        return await parser.parse()
    except MultiPartException as error:
        raise invalid(f"malformed multipart body: {error.message}") from None
