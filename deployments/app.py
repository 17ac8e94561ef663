"""build_app(args): the Serve application graph, Ingress -> one EngineDeployment per model (`llm_configs`),
with the ReplicaBoard, the Responses API's ResponseStore and the Batch API (which sends its batches to the
engines too)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pydantic import ValidationError
from ray.serve import Application

from deployments.access import read_access, serve_http_host
from deployments.app_args import AppConfig
from deployments.batch.api import BatchAPIDeployment
from deployments.engine import EngineDeployment
from deployments.ingress import Ingress
from deployments.model_copy import check_model
from deployments.replica_board import ReplicaBoard
from deployments.response_store import ResponseStoreDeployment


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Validate the application args and the model sources, and bind the deployments. Each replica
    prepares its model on its own node, into that node's cache folder (and on its node's device),
    unless the model's `engine_kwargs` set `cache_dir` or `device`."""
    try:
        config = AppConfig.from_args(args)
        for llm in config.llm_configs:
            llm.engine()  # its engine options together (a batch that fits, LoRA with what the model allows)
    except ValidationError as error:
        raise ValueError(f"invalid serve_app application args:\n{error}") from None
    for llm in config.llm_configs:
        check_model(llm.model_loading_config.source)
    # Read here, once: every ingress replica, on any node, knows the same keys and derives the same salts.
    access = read_access(config.server, serve_http_host())
    server = config.server
    board = ReplicaBoard.bind()
    engines = {
        llm.model_id: EngineDeployment.options(name=llm.deployment_name, **llm.serve_options()).bind(
            llm.model_dump(mode="json", exclude_defaults=True), board, server.model_dump(mode="json", exclude_defaults=True),
            server.otlp_traces_endpoint,
        )
        for llm in config.llm_configs
    }
    responses = ResponseStoreDeployment.bind(server.max_stored_responses, server.stored_response_max_age_s)
    app_config = config.model_dump(mode="json", exclude_defaults=True)
    batches = BatchAPIDeployment.bind(engines, board, app_config, asdict(access))
    return Ingress.bind(engines, board, responses, batches, app_config, asdict(access))
