"""OpenAI's batch file format: a request line (`{"custom_id", "method", "url", "body"}`) read and checked, each
line's key (its `custom_id`, which a results file is matched on), the key of the prompt prefix it shares with
others, and the result line written for it (`{"id", "custom_id", "response", "error"}`)."""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from typing import Any

# The routes a batch line may name (OpenAI's batch file format names these three among its endpoints).
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


@dataclass(frozen=True)
class BatchLine:
    """One request line, read: its `custom_id`, route and JSON body."""

    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineError(Exception):
    """A line that is not a request this batch can run: the result line's `error` (`code`, `message`)."""

    custom_id: str | None
    code: str
    message: str


def read_line(text: str) -> BatchLine:
    """The request `text` holds; LineError saying what is wrong with it (its custom_id where it has one)."""
    try:
        line = json.loads(text)
    except ValueError as error:
        raise LineError(None, "invalid_json", f"the line is not JSON: {error}") from None
    if not isinstance(line, dict):
        raise LineError(None, "invalid_request", "a line is a JSON object with custom_id, method, url and body")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(None, "invalid_request", "custom_id: a non-empty string is required")
    unknown = sorted(set(line) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise LineError(custom_id, "invalid_request", f"{unknown[0]}: not a field of a batch line")
    if line.get("method") != "POST":
        raise LineError(custom_id, "invalid_request", f"method: {line.get('method')!r}; a batch line's method is POST")
    url = line.get("url")
    if url not in BATCH_URLS:
        raise LineError(custom_id, "invalid_url", f"url: {url!r} is not a route a batch runs; those are {', '.join(BATCH_URLS)}")
    body = line.get("body")
    if not isinstance(body, dict):
        raise LineError(custom_id, "invalid_request", "body: the request's JSON object is required")
    if body.get("stream"):
        raise LineError(custom_id, "invalid_request", "body.stream: a batch's answers are whole; stream is not supported")
    return BatchLine(custom_id, url, body)


def line_key(text: str) -> str:
    """What a line's result is matched on (`result_key`): its custom_id, or for a line without one (an error
    line), the id its result line gets, made of the digest of its text."""
    try:
        custom_id = json.loads(text).get("custom_id")
    except (ValueError, AttributeError):
        custom_id = None
    if isinstance(custom_id, str) and custom_id:
        return custom_id
    return "batch_req_" + hashlib.sha256(text.encode()).hexdigest()[:32]


def prefix_key(text: str) -> str:
    """Lines with the same key share a prompt prefix worth keeping on one engine: a chat's turns before its last
    (with its tools and response format, which the template renders first). Any other line's key is its own."""
    try:
        line = json.loads(text)
        body = line["body"]
        messages = body["messages"]
        if isinstance(messages, list) and len(messages) > 1:
            shared = {"model": body.get("model"), "messages": messages[:-1], "tools": body.get("tools"),
                      "response_format": body.get("response_format")}
            return "prefix:" + hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:32]
    except (ValueError, TypeError, KeyError):
        pass
    return line_key(text)


def result_key(result: dict[str, Any]) -> str | None:
    """The key of the line a result line answers (`line_key`'s); None for what is not a result line."""
    if not isinstance(result, dict):
        return None
    key = result.get("custom_id") or result.get("id")
    return key if isinstance(key, str) else None


def result_line(custom_id: str | None, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """The result of a request that ran: its status code and body, as the API answered it."""
    return {
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": body.get("id") or f"req_{secrets.token_hex(12)}", "body": body},
        "error": None,
    }


def error_line(error: LineError, key: str) -> dict[str, Any]:
    """The result of the line (of `line_key` `key`) that could not run; one without a custom_id has `key` as id."""
    return {
        "id": key if error.custom_id is None else f"batch_req_{secrets.token_hex(12)}",
        "custom_id": error.custom_id,
        "response": None,
        "error": {"code": error.code, "message": error.message},
    }
