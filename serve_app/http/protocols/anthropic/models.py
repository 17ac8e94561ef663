"""Anthropic's model list (`GET /v1/models` with `anthropic-version`): the model cards as `{"type": "model", "id",
"display_name", "created_at"}`, a page at a time (`limit`, `after_id`, `before_id`)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from serve_app.http.protocols.errors import invalid

DEFAULT_LIMIT = 20
MAX_LIMIT = 1000


def anthropic_card(card: dict[str, Any]) -> dict[str, Any]:
    created = datetime.fromtimestamp(card["created"], timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": card["id"], "display_name": card["id"], "created_at": created}


def anthropic_page(cards: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """One page of the list: `limit` cards (1-1000, default 20) after `after_id` or before `before_id`."""
    unknown = sorted(set(query) - {"limit", "after_id", "before_id"})
    if unknown:
        raise invalid(f"{unknown[0]}: unrecognized query parameter", unknown[0])
    try:
        limit = int(query.get("limit", DEFAULT_LIMIT))
    except ValueError:
        raise invalid("limit: give an integer", "limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise invalid(f"limit: {limit} is outside 1..{MAX_LIMIT}", "limit")
    ids = [card["id"] for card in cards]
    start, end = 0, len(cards)
    for name in ("after_id", "before_id"):
        if name in query and query[name] not in ids:
            raise invalid(f"{name}: no model {query[name]!r}", name)
    if "after_id" in query:
        start = ids.index(query["after_id"]) + 1
    if "before_id" in query:
        end = ids.index(query["before_id"])
        start = max(start, end - limit)
    page = [anthropic_card(card) for card in cards[start:end][:limit]]
    return {
        "data": page,
        "has_more": start + len(page) < end or ("before_id" in query and start > 0),
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }
