"""The Anthropic Messages API: `/v1/messages` and token counting (schema.py: the bodies; builder.py: the answers)."""

from serve_app.http.protocols.anthropic.builder import ERRORS, MessagesBuilder, anthropic_error
from serve_app.http.protocols.anthropic.schema import CountTokensRequest, parse

__all__ = ["ERRORS", "CountTokensRequest", "MessagesBuilder", "anthropic_error", "parse"]
