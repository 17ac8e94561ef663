"""`answers_in(errors)`: a route whose errors, expected or not, come back in its API's shape."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

from fastapi import Request
from starlette.responses import Response

from serve_app.http.protocols.errors import ErrorFormat, ProtocolError

logger = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]


def answers_in(errors: ErrorFormat) -> Callable[[Endpoint], Endpoint]:
    """Decorate an endpoint so that a ProtocolError, or any fault of the server's, is answered in `errors`' shape."""

    def decorate(endpoint: Endpoint) -> Endpoint:
        @functools.wraps(endpoint)
        async def route(request: Request) -> Response:
            try:
                return await endpoint(request)
            except ProtocolError as error:
                return errors.response(error)
            except Exception:  # a server fault, never a client's: answer in the protocol's shape
                logger.exception("request failed")
                return errors.response(ProtocolError("internal", "internal server error"))

        return route

    return decorate
