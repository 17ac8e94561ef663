"""The message of a failed HTTP answer, from the server's error shape or its raw text."""

from __future__ import annotations

import httpx


def error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text
