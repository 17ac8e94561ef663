"""The KV-cache SDK: read, edit and write back a server's cached KV, and continue generating from it.

    ctx = connect("http://127.0.0.1:8000")
    stream = create_request(ctx, make_post_completion("http://127.0.0.1:8000"), prompt_ids)
    stream.generate({"max_tokens": 1})              # prefill: the prompt's KV is cached
    stream.modify_kv(lambda kv, tokens: (kv, tokens))  # edit the cached prefix
    stream.generate({"max_tokens": 64})             # decode from the edited KV
"""

from serve_app.kvsdk.batched import BatchedStream
from serve_app.kvsdk.completion import (
    CompletionError,
    CompletionOutput,
    PostCompletion,
    make_post_completion,
)
from serve_app.kvsdk.context import KVContext, KVError, connect
from serve_app.kvsdk.metrics import Metrics, StreamPerfMetrics
from serve_app.kvsdk.rope import rerotate_k
from serve_app.kvsdk.stream import RequestStream, RequestStreamError, create_request
from serve_app.wire.calls import KVConfig

__all__ = [
    "BatchedStream",
    "CompletionError",
    "CompletionOutput",
    "KVConfig",
    "KVContext",
    "KVError",
    "Metrics",
    "PostCompletion",
    "RequestStream",
    "RequestStreamError",
    "StreamPerfMetrics",
    "connect",
    "create_request",
    "make_post_completion",
    "rerotate_k",
]
