"""vLLM's `/tokenize` and `/detokenize` bodies: a prompt, or chat messages (rendered by the model's template with
their tools, as the chat route renders them), to token ids; token ids back to text."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from serve_app.http.protocols.fields import RequestModel, UnknownFields, from_validation_error, refuse_fields, validate_body
from serve_app.http.protocols.openai.schema import ChatMessage, ChatTool, chat_prompt
from serve_app.http.tools import format_for
from serve_app.http.tools.plan import ToolSpec, plan
from serve_app.wire.requests import GenerateRequest

UNSUPPORTED = {
    "chat_template": "not supported: the model's own template is used",
    "mm_processor_kwargs": "not supported: this model takes text only",
}


class TokenizePrompt(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(RequestModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: Literal[False] = False
    add_special_tokens: Literal[False] = Field(False, description="the template holds the special tokens")
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=64)


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int] = Field(min_length=1)


def tokenize_request(
    body: Any, tool_format: str, unknown: UnknownFields = "reject"
) -> tuple[TokenizePrompt | TokenizeChat, GenerateRequest]:
    """The body (a chat when it has `messages`), and the generation it would render, for the tokenizer."""
    body = refuse_fields(body, UNSUPPORTED)
    if isinstance(body, dict) and "messages" in body:
        chat = validate_body(TokenizeChat, body, unknown)
        specs = [ToolSpec(t.function.name, t.function.description, t.function.parameters) for t in chat.tools or []]
        prompt = chat_prompt(chat.messages, format_for(tool_format), plan(specs, None))
        try:
            rendered = GenerateRequest(
                messages=prompt.messages, tools=prompt.tools, chat_template_kwargs=chat.chat_template_kwargs, max_tokens=None
            )
        except ValidationError as error:
            raise from_validation_error(error) from None
        return chat, rendered
    text = validate_body(TokenizePrompt, body, unknown)
    return text, GenerateRequest(prompt=text.prompt, max_tokens=None)
