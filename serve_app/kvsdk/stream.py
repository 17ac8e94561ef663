"""RequestStream: one stateful stream of passes over a prompt: prefill -> modify KV -> decode.

The stream holds the tokens its next pass continues. `modify_kv` replaces the cached whole-page
prefix of those tokens by what a function makes of its KV; the uncached tail becomes the
suffix, sent (and prefilled) with the next pass.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from serve_app.kvsdk.completion import PostCompletion
from serve_app.kvsdk.context import KVContext
from serve_app.kvsdk.metrics import StreamPerfMetrics

if TYPE_CHECKING:
    import torch

ModifyFn = Callable[["torch.Tensor", list[int]], tuple["torch.Tensor", Sequence[int]]]


class RequestStreamError(RuntimeError):
    """A pass, retrieval or store of one stream failed."""

    def __init__(self, request_stream_id: str, message: str) -> None:
        super().__init__(f"request stream {request_stream_id}: {message}")
        self.request_stream_id = request_stream_id


class RequestStream:
    """`tokens` (what the next pass continues), `suffix_tokens` (sent after them), and what was generated.

    `decoded_tokens` and `output_text` accumulate over passes; `output_tokens` are the last pass's.
    `is_done` is set once a pass produced fewer tokens than its `max_tokens`.
    """

    def __init__(
        self,
        contexts: Mapping[str, KVContext],
        post_completion: PostCompletion,
        prompt_token_ids: Sequence[int],
        cache_salt: str = "",
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.request_stream_id = uuid.uuid4().hex[:12]
        self.contexts = dict(contexts)
        self.post_completion = post_completion
        self.cache_salt = cache_salt
        self.tokens: list[int] = list(prompt_token_ids)
        self.suffix_tokens: list[int] = []
        self.decoded_tokens: list[int] = []
        self.output_tokens: list[int] = []
        self.output_text = ""
        self.is_done = False

    def generate(self, sampling_params: Mapping[str, Any], suffix_tokens: Sequence[int] = ()) -> StreamPerfMetrics:
        """One pass over `tokens + suffix_tokens`; its output joins `tokens`."""
        prompt = self.tokens + self.suffix_tokens + list(suffix_tokens)
        try:
            output = self.post_completion(prompt, sampling_params, self.cache_salt)
        except Exception as error:
            raise RequestStreamError(self.request_stream_id, f"generation failed: {error}") from error
        self.tokens = prompt + output.token_ids
        self.suffix_tokens = []
        self.output_tokens = list(output.token_ids)
        self.decoded_tokens.extend(output.token_ids)
        self.output_text += output.text
        self.is_done = len(output.token_ids) < int(sampling_params.get("max_tokens", 16))
        return output.metrics

    def retrieve(self, kind: str = "kv", timeout: float = 30.0, poll_interval: float = 0.2) -> torch.Tensor:
        """The KV of the whole pages of `tokens` that have been computed, once they are cached."""
        context = self._context(kind)
        page = context.page_size
        # Every token but the last one generated has its KV computed.
        expected = (len(self.tokens) - 1) // page * page
        deadline = time.monotonic() + timeout
        try:
            while context.lookup(self.tokens, self.cache_salt) < expected and time.monotonic() < deadline:
                time.sleep(poll_interval)
            kv = context.retrieve(self.tokens, self.cache_salt)
        except Exception as error:
            raise RequestStreamError(self.request_stream_id, f"retrieve failed: {error}") from error
        if kv is None:
            raise RequestStreamError(self.request_stream_id, f"no whole page of {len(self.tokens)} tokens is cached")
        return kv

    def update(self, kind: str, kv: torch.Tensor, tokens: Sequence[int]) -> bool:
        """Store `kv` as the KV of `tokens`, which become the stream's tokens; True when a page was new."""
        try:
            stored = self._context(kind).store(kv, tokens, self.cache_salt)
        except Exception as error:
            raise RequestStreamError(self.request_stream_id, f"store failed: {error}") from error
        self.tokens = list(tokens)
        return stored

    def modify_kv(
        self, fn: ModifyFn, timeout: float = 30.0, poll_interval: float = 0.2, kind: str = "kv"
    ) -> StreamPerfMetrics:
        """Replace the cached prefix by `fn(kv, prefix_tokens) -> (new_kv, new_tokens)`; keep the tail as suffix.

        The metrics count the prefix's tokens in and the new tokens out, over the whole round trip.
        """
        start = time.perf_counter()
        kv = self.retrieve(kind, timeout, poll_interval)
        cached = kv.shape[2]
        tail = self.tokens[cached:]
        try:
            new_kv, new_tokens = fn(kv, self.tokens[:cached])
        except Exception as error:
            raise RequestStreamError(self.request_stream_id, f"the modify function failed: {error}") from error
        self.update(kind, new_kv, new_tokens)
        self.suffix_tokens = tail + self.suffix_tokens
        duration = time.perf_counter() - start
        return StreamPerfMetrics(
            duration=duration,
            input_tokens=cached,
            output_tokens=len(new_tokens),
            input_tput=cached / duration if duration > 0 else 0.0,
            output_tput=len(new_tokens) / duration if duration > 0 else 0.0,
        )

    def _context(self, kind: str) -> KVContext:
        if kind not in self.contexts:
            raise RequestStreamError(self.request_stream_id, f"no KV context of kind {kind!r}; have {sorted(self.contexts)}")
        return self.contexts[kind]


def create_request(
    contexts: KVContext | Sequence[KVContext] | Mapping[str, KVContext],
    post_completion: PostCompletion,
    prompt_token_ids: Sequence[int],
    cache_salt: str = "",
) -> RequestStream:
    """A request stream over `prompt_token_ids`; contexts are found by their `kind`."""
    if isinstance(contexts, KVContext):
        by_kind = {contexts.kind: contexts}
    elif isinstance(contexts, Mapping):
        by_kind = dict(contexts)
    else:
        by_kind = {context.kind: context for context in contexts}
    return RequestStream(by_kind, post_completion, prompt_token_ids, cache_salt)
