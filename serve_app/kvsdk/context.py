"""KVContext: one server's cached KV over HTTP (`/v1/kv/*`): lookup, retrieve and store by tokens."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import httpx

from serve_app.http.protocols.kv import MEDIA_TYPE, decode_kv, encode_kv
from serve_app.kvsdk.errors import error_message
from serve_app.wire.calls import KVConfig

if TYPE_CHECKING:
    import torch


class KVError(RuntimeError):
    """A KV call the server refused; `status` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class KVContext:
    """The cached KV of the server at `url` (of its model `model`; None: its first); `kind` names it among a
    request stream's contexts."""

    def __init__(
        self, url: str, kind: str = "kv", timeout: float = 60.0, api_key: str | None = None, model: str | None = None
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.kind = kind
        params = {"model": model} if model is not None else None
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, params=params)
        self.config = KVConfig.from_dict(self._json(self._client.get("/v1/kv/config")))

    @property
    def page_size(self) -> int:
        return self.config.page_size

    def lookup(self, tokens: Sequence[int], cache_salt: str = "") -> int:
        """How many leading tokens, in whole pages, are cached under `cache_salt` in the engine's pool."""
        return int(self._lookup(tokens, cache_salt)["cached_tokens"])

    def locate(self, tokens: Sequence[int], cache_salt: str = "") -> list[str]:
        """The tier holding each leading page held anywhere: "pool", then "host", "disk" or "cluster"."""
        return list(self._lookup(tokens, cache_salt)["pages"])

    def _lookup(self, tokens: Sequence[int], cache_salt: str) -> dict:
        body = {"tokens": list(tokens), "cache_salt": cache_salt}
        return self._json(self._client.post("/v1/kv/lookup", json=body))

    def retrieve(self, tokens: Sequence[int], cache_salt: str = "") -> torch.Tensor | None:
        """`[2, n_layers, T, n_kv_heads * head_dim]` for the longest cached whole-page prefix, or None."""
        response = self._client.post("/v1/kv/retrieve", json={"tokens": list(tokens), "cache_salt": cache_salt})
        if response.status_code == 404:
            return None
        _check(response)
        kv, _, _ = decode_kv(response.content)
        return kv

    def store(self, kv: torch.Tensor, tokens: Sequence[int], cache_salt: str = "") -> bool:
        """Cache `kv` as the KV of `tokens` (whole pages); False when every page was cached already."""
        return self.store_pages(kv, tokens, cache_salt)["stored"]

    def store_pages(self, kv: torch.Tensor, tokens: Sequence[int], cache_salt: str = "") -> dict[str, int | bool]:
        """As `store`, answering `stored`, `stored_pages` and `deduplicated_pages`."""
        body = encode_kv(kv.detach().cpu(), list(tokens), cache_salt)
        return self._json(self._client.post("/v1/kv/store", content=body, headers={"content-type": MEDIA_TYPE}))

    def close(self) -> None:
        self._client.close()

    def _json(self, response: httpx.Response) -> dict:
        _check(response)
        return response.json()


def _check(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise KVError(response.status_code, error_message(response))


def connect(
    url: str, kind: str = "kv", timeout: float = 60.0, api_key: str | None = None, model: str | None = None
) -> KVContext:
    """A `KVContext` for the server at `url` (its model `model`; None: its first), waiting up to `timeout`
    seconds for it to answer."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return KVContext(url, kind, timeout, api_key, model)
        except (httpx.TransportError, KVError) as error:
            retriable = isinstance(error, httpx.TransportError) or error.status == 503
            if not retriable or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
