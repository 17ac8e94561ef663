"""PromptEncoder: renders the chat template and tokenizes requests where the HTTP layer runs, whatever the
transport (Ray handles or an engine in process), so that a prompt is tokenized once, before routing:
engines get token ids, and the router hashes the pages of exactly the ids the engine will cache.
Tokenizing runs off the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from serve_app.http.protocols.errors import ProtocolError
from serve_app.model.tokenizer import Tokenizer
from serve_app.wire.refusals import RequestRefused
from serve_app.wire.requests import EncodedRequest, GenerateRequest


class PromptEncoder:
    """The model's tokenizer (transformers' tokenizer, not the model) applied to requests."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The ids the engine feeds for `request`: chat through the template, text encoded, ids as given."""
        with _refusals_as_errors():
            return self.tokenizer.prompt_ids(request)

    def _encode(self, request: GenerateRequest) -> tuple[list[int], int]:
        """The prompt's ids, and how many of them its `cache_prefix` keeps cached."""
        ids = list(request.prompt) if isinstance(request.prompt, list) else self.prompt_ids(request)
        with _refusals_as_errors():
            return ids, self.tokenizer.cached_prefix_length(request, ids)

    async def encode(
        self,
        requests: Sequence[GenerateRequest],
        tenant_salts: Sequence[str],
        trace_context: dict[str, str],
        choices_per_prompt: int = 1,
    ) -> list[EncodedRequest]:
        """Each request as the engine runs it, under its tenant salt. Requests come in runs of `choices_per_prompt`
        choices of one prompt: each prompt is tokenized once, off the event loop."""
        encoded: list[EncodedRequest] = []
        for index, (request, salt) in enumerate(zip(requests, tenant_salts)):
            if index % choices_per_prompt:
                first = encoded[index - index % choices_per_prompt]
                ids, pinned = first.prompt_ids, first.pin_tokens
            elif isinstance(request.prompt, list) and request.cache_prefix is None:
                ids, pinned = list(request.prompt), 0  # token ids as given: nothing to tokenize
            else:
                ids, pinned = await asyncio.to_thread(self._encode, request)
            encoded.append(EncodedRequest(request, ids, salt, trace_context, pinned))
        return encoded

    async def count(self, request: GenerateRequest) -> int:
        return len(await asyncio.to_thread(self.prompt_ids, request))

    async def tokenize(
        self, request: GenerateRequest, add_generation_prompt: bool = True, add_special_tokens: bool = True
    ) -> list[int]:
        """`/tokenize`: a chat through the template (its generation prompt where asked), or text (with the
        tokenizer's special tokens where asked), off the event loop."""

        def encode() -> list[int]:
            if request.messages is not None:
                with _refusals_as_errors():
                    return self.tokenizer.encode_chat(
                        request.messages, add_generation_prompt, request.tools, request.chat_template_kwargs
                    )
            return self.tokenizer.encode(request.prompt, add_special_tokens=add_special_tokens)

        return await asyncio.to_thread(encode)

    async def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary writes it."""
        return await asyncio.to_thread(self.tokenizer.token_strings, list(ids))

    async def detokenize(self, ids: Sequence[int]) -> str:
        """`/detokenize`: the text of `ids`, special tokens included (as vLLM's route decodes them)."""
        return await asyncio.to_thread(self.tokenizer.decode, ids, False)


@contextmanager
def _refusals_as_errors() -> Iterator[None]:
    """The tokenizer's refusals (a template that refuses the messages, a prompt of no tokens) as protocol errors."""
    try:
        yield
    except RequestRefused as refused:
        raise ProtocolError.of(refused) from None
