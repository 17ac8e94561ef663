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
from deployments.model_copy import check_model
from deployments.replica_board import ReplicaBoard
from deployments.response_store import ResponseStoreDeployment
from serve_app.config import AppConfig
from serve_app.http.tenants import KEYS_ENV

# Engine options whose defaults depend on the node a replica runs on: its cache folder
# (`$SERVE_APP_CACHE_DIR` there, else ~/.cache/serve-app) and its device (`$SERVE_APP_DEVICE` there).
NODE_DEFAULTS = ("cache_dir", "device")


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Validate the application args and the model source, and bind the deployments. Each replica
    prepares the model on its own node, into that node's cache folder."""
    try:
        config = AppConfig.from_args(args)
    except ValidationError as error:
        raise ValueError(f"invalid serve_app application args:\n{error}") from None
    check_model(config.engine.model.name)
    # Every ingress replica must derive the same salts and know the same keys.
    server = config.server.model_copy(
        update={
            "api_keys_file": config.server.api_keys_file or os.environ.get(KEYS_ENV),
            "cache_salt_secret": config.server.cache_salt_secret or secrets.token_hex(32),
        }
    )
    config = config.model_copy(update={"server": server})
    dumped = config.model_dump(mode="json")
    for key in NODE_DEFAULTS:  # left open unless the args set them: each replica's node decides
        if key not in (args or {}):
            del dumped["engine"]["model"][key]
    board = ReplicaBoard.bind()
    engine = EngineDeployment.bind(dumped, board)
    responses = ResponseStoreDeployment.bind(server.max_stored_responses, server.stored_response_max_age_s)
    return Ingress.bind(engine, board, responses, dumped)
