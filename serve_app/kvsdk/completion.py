"""How a request stream runs a pass: the `PostCompletion` protocol and the default HTTP engine call."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from serve_app.kvsdk.errors import error_message
from serve_app.kvsdk.metrics import StreamPerfMetrics


class CompletionError(RuntimeError):
    """The engine refused or failed a pass."""


@dataclass(frozen=True)
class CompletionOutput:
    """What one pass generated, and how long it took."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: StreamPerfMetrics
    cached_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class PostCompletion(Protocol):
    """Continue `prompt_token_ids` with `sampling_params` (`max_tokens`, `temperature`, ...) under a salt."""

    def __call__(
        self, prompt_token_ids: Sequence[int], sampling_params: Mapping[str, Any], cache_salt: str
    ) -> CompletionOutput: ...


class HTTPCompletion:
    """Streaming `/v1/completions` with token-id prompts and `return_token_ids`, timed per token."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None, timeout: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)
        self._model = model

    @property
    def model(self) -> str:
        if self._model is None:
            response = self._client.get("/v1/models")
            _raise_for(response)
            self._model = response.json()["data"][0]["id"]
        return self._model

    def __call__(
        self, prompt_token_ids: Sequence[int], sampling_params: Mapping[str, Any], cache_salt: str
    ) -> CompletionOutput:
        body = {
            "model": self.model,
            **sampling_params,
            "prompt": list(prompt_token_ids),
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if cache_salt:
            body["cache_salt"] = cache_salt
        start = time.perf_counter()
        stamps: list[float] = []
        token_ids: list[int] = []
        text: list[str] = []
        finish_reason = None
        cached = 0
        with self._client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                _raise_for(response)
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise CompletionError(chunk["error"].get("message", "generation failed"))
                if chunk.get("usage"):
                    cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                for choice in chunk["choices"]:
                    now = time.perf_counter()
                    stamps.extend([now] * len(choice["token_ids"]))
                    token_ids.extend(choice["token_ids"])
                    text.append(choice["text"])
                    finish_reason = choice["finish_reason"] or finish_reason
        metrics = StreamPerfMetrics.from_stamps(start, stamps, time.perf_counter(), len(prompt_token_ids))
        return CompletionOutput(token_ids, "".join(text), finish_reason, metrics, cached)

    def close(self) -> None:
        self._client.close()


def make_post_completion(
    url: str, model: str | None = None, api_key: str | None = None, timeout: float = 600.0
) -> HTTPCompletion:
    """The default engine call: this server's streaming `/v1/completions` at `url`."""
    return HTTPCompletion(url, model, api_key, timeout)


def _raise_for(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise CompletionError(f"HTTP {response.status_code}: {error_message(response)}")
