"""The web page at `/`: a chat playground and a live view of the replicas (one static file, no build step).
It calls the server's own API from the browser, with the API key the user types into it."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from starlette.responses import HTMLResponse

router = APIRouter()
PAGE = Path(__file__).parent.parent / "web" / "index.html"


@router.get("/", include_in_schema=False)
async def page() -> HTMLResponse:
    return HTMLResponse(PAGE.read_text(encoding="utf-8"))
