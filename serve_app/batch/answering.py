"""A request answered without HTTP as its route answers it over HTTP (the same builders, limits and errors):
`answer_request`, which the engine deployment's `chat` and `completions` use for Ray Data LLM, and
`BatchAnswerer`, which answers a batch line into its result line: a response with the status and body the route
would have sent, or an error for a line that is not a request this batch runs."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serve_app.batch.file_format import LineError, error_line, line_key, read_line, result_line
from serve_app.http.engine_client import EngineClient
from serve_app.http.protocols.base import ProtocolHandler, RequestObserver, ResponseBuilder
from serve_app.http.protocols.errors import ProtocolError
from serve_app.http.protocols.limits import RequestLimits
from serve_app.http.protocols.openai import ChatCompletionsBuilder, CompletionsBuilder
from serve_app.http.protocols.openai.embeddings import EmbeddingsBuilder
from serve_app.http.served_models import ServedModels

logger = logging.getLogger(__name__)

BUILDERS: dict[str, ResponseBuilder] = {
    "/v1/chat/completions": ChatCompletionsBuilder(),
    "/v1/completions": CompletionsBuilder(),
    "/v1/embeddings": EmbeddingsBuilder(),
}


async def answer_request(
    url: str,
    engine: EngineClient | ServedModels,
    body: Any,
    limits: RequestLimits,
    tenant_salt: Callable[[str | None], str] | None = None,
    observer: RequestObserver | None = None,
    background: bool = False,
) -> tuple[int, dict[str, Any]]:
    """The status and JSON body the route at `url` (one of BUILDERS) answers `body` with, by `engine` (or by the
    served model the body names); a `background` request runs in what online requests leave over."""
    builder = BUILDERS[url]
    try:
        client = engine.client_of(body) if isinstance(engine, ServedModels) else engine
        response = await ProtocolHandler(builder, client, observer).handle(body, tenant_salt, limits, background=background)
    except ProtocolError as error:
        response = builder.errors.response(error)
    except Exception:  # a server fault, never the request's: answered as the route answers one
        logger.exception("a request answered without HTTP failed")
        response = builder.errors.response(ProtocolError("internal", "internal server error"))
    return response.status_code, json.loads(bytes(response.body))


@dataclass(frozen=True)
class AnsweredLine:
    """A line's result line (JSON text), the key it answers, and what it counts for the summary."""

    key: str
    result: str
    failed: bool
    status_code: int | None = None  # the route's status; None for a line that could not run
    prompt_tokens: int = 0
    completion_tokens: int = 0


class BatchAnswerer:
    """Answers batch lines with the served models, held to `limits`, every prompt cached under `tenant_salt`'s
    salt (a batch's tenant); `background` where they share the engines with online requests."""

    def __init__(
        self,
        models: ServedModels,
        limits: RequestLimits,
        tenant_salt: Callable[[str | None], str] | None = None,
        observer: RequestObserver | None = None,
        background: bool = False,
    ) -> None:
        self.models = models
        self.limits = limits
        self.tenant_salt = tenant_salt
        self.observer = observer
        self.background = background

    async def answer(self, text: str) -> AnsweredLine:
        key = line_key(text)
        try:
            line = read_line(text)
        except LineError as error:
            return AnsweredLine(key, json.dumps(error_line(error, key)), failed=True)
        status, body = await answer_request(
            line.url, self.models, line.body, self.limits, self.tenant_salt, self.observer, self.background
        )
        usage = body.get("usage") if status == 200 else None
        usage = usage if isinstance(usage, dict) else {}
        return AnsweredLine(
            key, json.dumps(result_line(line.custom_id, status, body), ensure_ascii=False), failed=status != 200,
            status_code=status,
            prompt_tokens=usage.get("prompt_tokens") or 0, completion_tokens=usage.get("completion_tokens") or 0,
        )
