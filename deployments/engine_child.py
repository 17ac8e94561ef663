"""`python -m deployments.engine_child STREAM_FD CALL_FD`: the engine deployment's engine process,
`serve_app.engine.child` handed the KV tiers kept in Ray (host and cluster, where the config names them)."""

from __future__ import annotations

import sys

from serve_app.config import KVTiersConfig
from serve_app.engine.child import main
from serve_app.kv.tiers.store import PageSource, PageStore


def ray_tiers(config: KVTiersConfig) -> tuple[list[PageStore], list[PageSource]]:
    """`deployments.kv_tiers.ray_stores.ray_tiers`, imported only by an engine whose config names Ray's tiers:
    one without them never loads Ray."""
    from deployments.kv_tiers.ray_stores import ray_tiers as build

    return build(config)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), ray_tiers)
