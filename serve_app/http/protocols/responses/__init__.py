"""The OpenAI Responses API: `/v1/responses` (schema.py: the body; builder.py: the answers and events)."""

from serve_app.http.protocols.responses.builder import ResponsesBuilder, ResponsesFormatter

__all__ = ["ResponsesBuilder", "ResponsesFormatter"]
