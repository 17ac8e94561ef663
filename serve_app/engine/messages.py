"""The typed messages between `EngineProcess` (the host) and the engine's own process (`child`).

Two connections join them, so that a big answer never holds up a stream:

    stream channel, host -> engine          stream channel, engine -> host
    Submit(call_id, request)                Ready(...) or Failed(reason), once, first
    Abort(task_id)                          Accepted(call_id, task_id) or Refused(call_id, error)
    Withdraw(call_id)
    ResendPages()                           Outputs([(call_id, CoreOutput), ...]), one per scheduler round
    Shutdown()                              Health(stats, healthy), when they change
                                            PagesChanged(batch), after a round that cached or evicted pages

    call channel, host -> engine            call channel, engine -> host
    Call(call_id, EngineCall)               Reply(call_id, ok, value or error)

The host sends the `EngineConfig` (JSON bytes) on the stream channel before anything else. A
request's outputs are token ids (the host makes their text), keyed by its submit's call id, so they may arrive
before its `Accepted`. KV tensors of up to a gigabyte travel only on the call channel. Messages are plain pickles (`send`, `receive`), not multiprocessing's,
which would move tensors to shared memory.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from serve_app.wire.calls import EngineCall
from serve_app.wire.model_card import ReasoningParser, ToolFormat
from serve_app.wire.outputs import CoreOutput
from serve_app.wire.page_events import PageEventBatch
from serve_app.wire.requests import EncodedRequest


@dataclass(frozen=True)
class Ready:
    """The engine is loaded: its model's folder (for the host's tokenizer), context limit, creation time, tool-call
    format, reasoning parser, vocabulary size and first stats."""

    model_path: str
    max_model_len: int
    created: int
    tool_format: ToolFormat
    reasoning_parser: ReasoningParser | None
    vocab_size: int
    hidden_size: int
    stats: dict[str, int]


@dataclass(frozen=True)
class Failed:
    """The engine could not be loaded; `reason` is the child's traceback."""

    reason: str


@dataclass(frozen=True)
class Submit:
    call_id: int
    request: EncodedRequest


@dataclass(frozen=True)
class Abort:
    task_id: int


@dataclass(frozen=True)
class Withdraw:
    """The caller of submit `call_id` has gone before its `Accepted`: abandon its grammar's compile, queue nothing
    (the engine answers `Refused`)."""

    call_id: int


@dataclass(frozen=True)
class ResendPages:
    """Send a snapshot of the prefix cache's pages with the next `PagesChanged`."""


@dataclass(frozen=True)
class Shutdown:
    """Cancel every unfinished request and exit."""


@dataclass(frozen=True)
class Accepted:
    """The engine queued the request of `call_id` as task `task_id` (the id to abort it by)."""

    call_id: int
    task_id: int


@dataclass(frozen=True)
class Refused:
    """The engine would not queue the request of `call_id`; `error` is what it raised."""

    call_id: int
    error: Exception


@dataclass(frozen=True)
class Outputs:
    """Every output one scheduler round published (token ids, logprobs, finish reasons, usage), in order, each with
    its request's submit call id."""

    items: list[tuple[int, CoreOutput]]


@dataclass(frozen=True)
class Health:
    """The engine's stats and whether it can still serve (a scheduler whose steps keep failing cannot)."""

    stats: dict[str, int]
    healthy: bool


@dataclass(frozen=True)
class PagesChanged:
    """Page hashes the prefix cache published and dropped in one scheduler round."""

    batch: PageEventBatch


@dataclass(frozen=True)
class Call:
    call_id: int
    call: EngineCall


@dataclass(frozen=True)
class Reply:
    call_id: int
    ok: bool
    value: Any


ToEngine = Submit | Abort | Withdraw | ResendPages | Shutdown | Call
FromEngine = Ready | Failed | Accepted | Refused | Outputs | Health | PagesChanged | Reply


def send(conn: Connection, message: ToEngine | FromEngine) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def portable(error: Exception) -> Exception:
    """`error` if it pickles (the host re-raises it as it is), else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
