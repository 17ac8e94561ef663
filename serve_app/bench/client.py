"""A light load-generating client: streaming completions over aiohttp, timed per request.

A load generator shares the machine with the server, so it parses the server-sent events itself
instead of building SDK objects for every chunk (as vLLM's serving benchmark does). Every chunk
is counted by its token ids, so the first token counts even when its text is empty (an EOS when
EOS is ignored), the same event the in-process benchmark times: this server's `/v1/completions`
sends them with `return_token_ids`, llama.cpp's `llama-server` sends them on its own
`/completion` route (API `llama.cpp`), each chunk one token. The `chat` API streams `/v1/chat/completions`
(both servers, each through its own chat template): its chunks carry text, not token ids, so a request's
tokens are the usage its last chunk reports and its first token is the first chunk with text.
"""

from __future__ import annotations

import json
import time
from types import TracebackType

import aiohttp

from serve_app.bench.stats import RequestTiming


class CompletionClient:
    """One HTTP session for many concurrent greedy streaming completions (EOS ignored)."""

    ROUTES = {"openai": "/v1/completions", "llama.cpp": "/completion", "chat": "/v1/chat/completions"}

    def __init__(self, url: str, timeout_s: float = 600.0, api: str = "openai", close_connections: bool = False) -> None:
        """`close_connections`: one connection per request (llama-server closes idle kept-alive ones itself)."""
        if api not in self.ROUTES:
            raise ValueError(f"unknown completion API {api!r}")
        self._api = api
        self._url = url + self.ROUTES[api]
        connector = aiohttp.TCPConnector(limit=0, force_close=close_connections)
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def __aenter__(self) -> CompletionClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        await self._session.close()

    async def stream(self, model: str, prompt: str | list[int] | list[dict], max_tokens: int) -> RequestTiming:
        """One streamed request: a text or token-id prompt, or a chat's messages with the `chat` API."""
        body = self._body(model, prompt, max_tokens)
        start = time.perf_counter()
        first: float | None = None
        last = start
        tokens = 0
        reported: int | None = None  # the usage the last chunk reports, where it does
        arrivals: list[float] = []
        async with self._session.post(self._url, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream failed: {chunk['error']}")
                if chunk.get("usage"):
                    reported = chunk["usage"]["completion_tokens"]
                count = self._tokens_in(chunk)
                if count:
                    last = time.perf_counter()
                    first = first or last
                    tokens += count
                    arrivals.append(last)
        if first is None:
            return RequestTiming(ttft=0.0, gaps=(), output_tokens=0)
        if self._api == "chat":
            if reported is None:
                raise RuntimeError("a chat stream ended without its usage")
            tokens = reported
        # A chunk may carry several tokens: spread the stream's duration over them.
        gaps = ((last - first) / max(1, tokens - 1),) * max(0, tokens - 1)
        chunk_gaps = tuple(b - a for a, b in zip(arrivals, arrivals[1:]))
        return RequestTiming(ttft=first - start, gaps=gaps, output_tokens=tokens, chunk_gaps=chunk_gaps)

    def _body(self, model: str, prompt: str | list[int] | list[dict], max_tokens: int) -> dict:
        if self._api == "llama.cpp":
            return {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        if self._api == "chat":
            return {
                "model": model, "messages": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True},
            }
        return {
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True,
        }

    def _tokens_in(self, chunk: dict) -> int:
        """Tokens in one chunk; with the `chat` API, 1 for a chunk with text (the usage counts them)."""
        if self._api == "chat":
            return int(any(choice["delta"].get("content") for choice in chunk["choices"]))
        if self._api == "llama.cpp":  # the last chunk (`stop`) repeats nothing unless asked to
            return 0 if chunk.get("stop") else len(chunk.get("tokens", ()))
        return sum(len(choice["token_ids"] or ()) for choice in chunk["choices"])
