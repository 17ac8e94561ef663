"""Ingress: the HTTP API (serve_app.http.app) with each model's engine client made of Ray Serve handles
(`deployments.engine_clients`), stored responses and the Batch API in deployments of their own."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.access import ServerAccess
from deployments.app_args import AppConfig
from deployments.batch.api import RayBatches
from deployments.engine_clients import served_models
from deployments.ray_metrics import RayMetrics
from deployments.response_store import RayResponses
from serve_app.http.app import create_api
from serve_app.http.context import ServerContext
from serve_app.metrics import tracing
from serve_app.metrics.catalog import REQUEST_METRICS
from serve_app.metrics.prometheus import ServerMetrics


@serve.deployment(name="Ingress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    def __init__(
        self,
        engines: dict[str, DeploymentHandle],
        board: DeploymentHandle,
        responses: DeploymentHandle,
        batches: DeploymentHandle,
        config: dict[str, Any],
        access: dict[str, Any],
    ) -> None:
        """`engines`: each model's engine deployment, by model id; `access`: the `ServerAccess` read at build."""
        app_config = AppConfig.model_validate(config)
        server = app_config.server
        tracing.configure(server.otlp_traces_endpoint, "serve-app-ingress")
        tenants = ServerAccess(**access).tenants()
        replica = serve.get_replica_context().replica_id.unique_id
        metrics = ServerMetrics(replica, RayMetrics(REQUEST_METRICS), server.metrics_names)
        self.context = ServerContext(
            served_models(app_config, engines, board), server, metrics, tenants=tenants,
            responses=RayResponses(responses), batches=RayBatches(batches),
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_api(self.context)
