"""build_app(args): the Serve application graph, Ingress -> EngineDeployment, with the ReplicaBoard and
the Responses API's ResponseStore."""

from __future__ import annotations

import os
import secrets
from typing import Any

from pydantic import ValidationError
from ray.serve import Application

from deployments.engine import EngineDeployment
from deployments.ingress import Ingress
from deployments.replica_board import ReplicaBoard
from deployments.response_store import ResponseStoreDeployment
from serve_app.config import AppConfig
from serve_app.http.tenants import KEYS_ENV
from serve_app.model.loader import resolve_model_path


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Validate the application args, prepare the model once, and bind the deployments."""
    try:
        config = AppConfig.from_args(args)
    except ValidationError as error:
        raise ValueError(f"invalid serve_app application args:\n{error}") from None
    resolve_model_path(config.engine.model.name, config.engine.model.cache_dir)
    # Every ingress replica must derive the same salts and know the same keys.
    server = config.server.model_copy(
        update={
            "api_keys_file": config.server.api_keys_file or os.environ.get(KEYS_ENV),
            "cache_salt_secret": config.server.cache_salt_secret or secrets.token_hex(32),
        }
    )
    config = config.model_copy(update={"server": server})
    dumped = config.model_dump(mode="json")
    board = ReplicaBoard.bind()
    engine = EngineDeployment.bind(dumped, board)
    responses = ResponseStoreDeployment.bind(server.max_stored_responses, server.stored_response_max_age_s)
    return Ingress.bind(engine, board, responses, dumped)
