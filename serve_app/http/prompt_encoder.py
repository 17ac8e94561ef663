"""PromptEncoder: renders the chat template and tokenizes a request where the HTTP layer runs, so
that a prompt is tokenized once, before routing: engines get token ids, and the router hashes
the pages of exactly the ids the engine will cache. Tokenizing runs off the event loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

from serve_app.engine.io import GenerateRequest
from serve_app.errors import InvalidRequestError
from serve_app.http.protocols.errors import invalid


class PromptEncoder:
    """The model's tokenizer (loaded here: transformers, not the model) and the ids of requests."""

    def __init__(self, model_path: Path) -> None:
        from serve_app.model.tokenizer import Tokenizer

        self.tokenizer = Tokenizer(model_path)

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The ids the engine would feed for `request`: chat through the template, text encoded, ids as given."""
        try:
            return self.tokenizer.prompt_ids(request.prompt, request.messages, request.tools)
        except InvalidRequestError as error:
            raise invalid(str(error), error.param) from None

    async def encode(self, request: GenerateRequest) -> GenerateRequest:
        """`request` with its prompt as token ids (a copy; ids pass through untouched)."""
        if isinstance(request.prompt, list):
            return request
        ids = await asyncio.to_thread(self.prompt_ids, request)
        return request.model_copy(update={"prompt": ids, "messages": None, "tools": None})

    async def count(self, request: GenerateRequest) -> int:
        return len(await asyncio.to_thread(self.prompt_ids, request))
