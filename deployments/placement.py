"""Where an engine replica runs, as Ray placed it: a GPU only when Ray gave the replica one, and as
many CPU threads as the CPUs Ray reserved for it, unless the config names the device or the threads;
KV tiers on the replica's node, reached through the replica's Ray cluster.

Ray 2.60 no longer hides the node's GPUs from an actor with `num_gpus: 0`, so torch can see a device
that Ray did not give this replica; using it would take another replica's GPU."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import ray

from serve_app.config import EngineConfig

# Serve writes this logger to the replica's log (`logs/serve/replica_...`).
logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Placement:
    """What Ray gave the replica: its GPU ids, its CPU reservation, its node and cluster."""

    gpu_ids: Sequence[str]
    cpus: float
    node_id: str | None = None
    gcs_address: str | None = None

    @classmethod
    def of_this_actor(cls) -> Placement:
        context = ray.get_runtime_context()
        return cls(gpu_ids=list(context.get_accelerator_ids().get("GPU", [])),
                   cpus=float(context.get_assigned_resources().get("CPU", 0.0)),
                   node_id=context.get_node_id(), gcs_address=context.gcs_address)

    def apply(self, config: EngineConfig) -> EngineConfig:
        """`config` with the device and threads Ray's placement implies where the config leaves them open."""
        model = config.model
        options: dict[str, object] = {}
        if model.device == "auto":
            options["device"] = "cuda" if self.gpu_ids else "cpu"
            if not self.gpu_ids:
                logger.info("no GPU assigned by Ray (num_gpus: 0): the engine runs on the CPU")
        if model.num_threads is None:
            options["num_threads"] = max(1, math.floor(self.cpus))
        tiers = config.tiers
        if tiers.needs_ray and tiers.ray_address is None:
            options["kv_tiers"] = {**tiers.model_dump(), "ray_address": self.gcs_address, "node_id": self.node_id}
        placed = config.with_options(**options) if options else config
        logger.info(
            "engine placement: device %s, %s CPU threads (Ray gave GPUs %s, %s CPUs)",
            placed.model.device, placed.model.num_threads, list(self.gpu_ids) or "none", self.cpus,
        )
        return placed
