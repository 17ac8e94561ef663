"""serve_app: an LLM inference engine with a paged KV cache and continuous batching, served by Ray Serve."""

from serve_app.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from serve_app.engine import InferenceEngine
from serve_app.request import GenerateRequest, GenerateResult, StreamDelta, Usage

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "GenerateRequest",
    "GenerateResult",
    "InferenceEngine",
    "ModelConfig",
    "SchedulerConfig",
    "StreamDelta",
    "Usage",
]
