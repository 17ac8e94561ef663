"""ServedModels: the models a server answers for, each behind an engine client of its own. A request's
`model` (`<model_id>`, or `<model_id>:<adapter>` for a LoRA adapter) picks the client; a model not served
here is a 404 naming it, in every API."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from serve_app.http.engine_client import EngineClient
from serve_app.http.protocols.errors import ProtocolError
from serve_app.wire.calls import ListAdapters
from serve_app.wire.model_card import ModelInfo


def adapter_of(model: ModelInfo, requested: str, param: str = "model") -> str | None:
    """The LoRA adapter a request's `model` names (`<id>:<adapter>`; None for the model itself);
    ProtocolError `not_found` (404) for a model not served here."""
    if requested == model.id:
        return None
    base, _, adapter = requested.partition(":")
    if base == model.id and adapter:
        return adapter
    raise ProtocolError("not_found", f"{param}: {requested!r} is not served by this engine ({model.id!r})", param)


class ServedModels:
    def __init__(self, clients: Mapping[str, EngineClient]) -> None:
        if not clients:
            raise ValueError("a server needs a model to serve")
        self._clients = dict(clients)

    @property
    def first(self) -> EngineClient:
        """The first model's client: the KV routes' engine when they name none, and where stats that span every
        engine are read."""
        return next(iter(self._clients.values()))

    def client_for(self, requested: Any) -> EngineClient:
        """The client of the model that `requested` names; a value that is not a string gets the first model's,
        whose request parser then names what is wrong with it."""
        if not isinstance(requested, str):
            return self.first
        client = self._clients.get(requested.partition(":")[0])
        if client is None:
            served = ", ".join(repr(model) for model in self._clients)
            raise ProtocolError("not_found", f"model: {requested!r} is not served here; served: {served}", "model")
        return client

    def client_of(self, body: Any) -> EngineClient:
        """The client of the model a request body names in its `model` field."""
        return self.client_for(body.get("model") if isinstance(body, dict) else None)

    async def ready(self) -> bool:
        """Every model has an engine replica up."""
        for client in self._clients.values():
            if not await client.ready():
                return False
        return True

    async def cards(self) -> list[dict[str, Any]]:
        """The model cards of `/v1/models`: each model, then its LoRA adapters (`<model_id>:<adapter>`, with
        `parent`), in the form of vLLM and Ray Serve LLM."""
        cards = []
        for client in self._clients.values():
            info = await client.model_info()
            card = {
                "id": info.id,
                "object": "model",
                "created": info.created,
                "owned_by": "serve-app",
                "root": info.id,
                "parent": None,
                "max_model_len": info.max_model_len,
            }
            cards.append(card)
            for name in await client.ask(ListAdapters()):
                cards.append({**card, "id": f"{info.id}:{name}", "root": name, "parent": info.id})
        return cards
