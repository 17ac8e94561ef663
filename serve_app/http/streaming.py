"""ClosingStreamingResponse: a server-sent event stream whose clean-ups always run.

Starlette may stop a stream before it ever reads the body (the client went away at the
headers), and then a generator's `finally` never runs. Here the clean-ups (closing the engine
streams, giving back the tenant's slot, recording metrics) run when sending ends, however it ends.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

CleanUp = Callable[[], Awaitable[None] | None]


class ClosingStreamingResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[str], clean_ups: list[CleanUp] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._clean_ups = list(clean_ups or [])
        self._closed = False

    def call_on_close(self, clean_up: CleanUp) -> None:
        """Run `clean_up` once the response is over (after the ones added before it)."""
        self._clean_ups.append(clean_up)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()

    async def close(self) -> None:
        """Close the body and run every clean-up, once; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        closer = getattr(self.body_iterator, "aclose", None)
        if closer is not None:
            await closer()
        for clean_up in self._clean_ups:
            outcome = clean_up()
            if inspect.isawaitable(outcome):
                await outcome
