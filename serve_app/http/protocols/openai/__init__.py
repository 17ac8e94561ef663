"""The OpenAI APIs: `/v1/chat/completions` and the legacy `/v1/completions` (schema.py: the bodies; builders.py:
the answers)."""

from serve_app.http.protocols.openai.builders import ERRORS, ChatCompletionsBuilder, CompletionsBuilder, openai_error

__all__ = ["ERRORS", "ChatCompletionsBuilder", "CompletionsBuilder", "openai_error"]
