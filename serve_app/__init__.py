"""serve_app: an LLM inference engine with a paged KV cache and continuous batching, served by Ray Serve.

The names below load on first use, so that importing a part of the package (the HTTP layer in
an ingress replica) does not load torch and the model code.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CacheConfig": "serve_app.config",
    "DeltaStream": "serve_app.engine.delta_stream",
    "EngineConfig": "serve_app.config",
    "ModelConfig": "serve_app.config",
    "SchedulerConfig": "serve_app.config",
    "InferenceEngine": "serve_app.engine.engine",
    "GenerateRequest": "serve_app.wire.requests",
    "RequestOutput": "serve_app.wire.outputs",
    "SamplingParams": "serve_app.wire.requests",
    "StreamDelta": "serve_app.wire.outputs",
    "StructuredOutput": "serve_app.wire.requests",
    "Usage": "serve_app.wire.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'serve_app' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
