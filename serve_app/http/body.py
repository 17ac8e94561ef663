"""Reading request bodies: a byte limit (413), and JSON that is really JSON (400)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from serve_app.http.protocols.errors import ProtocolError, invalid


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
