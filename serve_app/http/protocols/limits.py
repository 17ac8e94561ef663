"""RequestLimits: the bounds every generation request is held to before any work is done for it, each breach a
400 naming its field and limit: choices (prompts x `n`), stop sequences, messages, characters before
tokenizing, output tokens, and token ids and `top_k` within the model's vocabulary; and whether a field the API
does not have is refused or only logged (`unknown_fields`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from serve_app.config import ServerConfig
from serve_app.engine.grammar_bounds import check_size
from serve_app.http.protocols.errors import ProtocolError, invalid
from serve_app.http.protocols.fields import UnknownFields
from serve_app.http.protocols.prepared import PreparedRequest
from serve_app.wire.model_card import ModelInfo
from serve_app.wire.refusals import RequestRefused
from serve_app.wire.requests import GenerateRequest, token_id_outside

# Without `max_prompt_characters`, a prompt may have this many characters per token of the model's context:
# far more than any text needs (English runs about 4 a token), and few enough to tokenize in well under a second.
CHARACTERS_PER_TOKEN = 16


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 16
    max_choices: int = 128
    max_stop_sequences: int = 16
    max_stop_length: int = 256
    max_messages: int = 1024
    max_prompt_characters: int | None = None
    max_output_tokens: int | None = None
    max_constrained_tokens: int | None = None
    unknown_fields: UnknownFields = "reject"

    @classmethod
    def from_config(cls, config: ServerConfig) -> RequestLimits:
        return cls(
            max_n=config.max_n,
            max_choices=config.max_choices,
            max_stop_sequences=config.max_stop_sequences,
            max_stop_length=config.max_stop_length,
            max_messages=config.max_messages,
            max_prompt_characters=config.max_prompt_characters,
            max_output_tokens=config.max_output_tokens,
            max_constrained_tokens=config.max_constrained_tokens,
            unknown_fields=config.unknown_fields,
        )

    def check_choices(self, n: int, prompts: int = 1, prompt_param: str = "prompt") -> None:
        """Before a builder makes a request per choice: `n` within `max_n`, and prompts x `n` within `max_choices` (the
        prompts named as the API calls them: `prompt_param`)."""
        if n > self.max_n:
            raise invalid(f"n: {n} choices are over max_n={self.max_n}", "n")
        if prompts * n > self.max_choices:
            raise invalid(
                f"{prompt_param}: {prompts} prompts x n={n} make {prompts * n} choices, over max_choices={self.max_choices}",
                prompt_param,
            )

    def prompt_characters(self, model: ModelInfo) -> int:
        """The characters a request's prompt may have before it is tokenized."""
        if self.max_prompt_characters is not None:
            return self.max_prompt_characters
        return CHARACTERS_PER_TOKEN * model.max_model_len

    def apply(
        self,
        prepared: PreparedRequest,
        model: ModelInfo,
        stop_param: str = "stop",
        max_tokens_param: str = "max_tokens",
        messages_param: str = "messages",
        prompt_param: str = "prompt",
    ) -> None:
        """Check `prepared` against the limits (each error naming the field as the protocol calls it); a
        request without `max_tokens` gets `max_output_tokens`, and a JSON or tool-call answer's constrained
        part `max_constrained_tokens` (its requests are replaced so)."""
        self.check_choices(prepared.choices_per_prompt, len(prepared.requests) // prepared.choices_per_prompt, prompt_param)
        first = prepared.requests[0]
        if len(first.stop) > self.max_stop_sequences:
            raise invalid(
                f"{stop_param}: {len(first.stop)} stop sequences are over max_stop_sequences={self.max_stop_sequences}",
                stop_param,
            )
        longest = max((len(stop) for stop in first.stop), default=0)
        if longest > self.max_stop_length:
            raise invalid(
                f"{stop_param}: a stop sequence of {longest} characters is over max_stop_length={self.max_stop_length}",
                stop_param,
            )
        if first.messages is not None and len(first.messages) > self.max_messages:
            raise invalid(
                f"{messages_param}: {len(first.messages)} messages are over max_messages={self.max_messages}",
                messages_param,
            )
        for request in prepared.requests[:: prepared.choices_per_prompt]:
            self.check_characters(request, model, messages_param, prompt_param)
            check_vocabulary(request, model.vocab_size, prompt_param)
            if request.structured_output is not None:  # refused here, before it is tokenized, routed or compiled
                try:
                    check_size(request.structured_output, model.grammar)
                except RequestRefused as refused:
                    raise ProtocolError.of(refused) from None
        asked = first.max_tokens
        spec = first.structured_output
        if asked is None and self.max_constrained_tokens is not None and spec is not None and spec.is_json:
            bound = {"max_constrained_tokens": self.max_constrained_tokens}
            prepared.requests = [r.model_copy(update=bound) for r in prepared.requests]
        if self.max_output_tokens is None:
            return
        if asked is not None and asked > self.max_output_tokens:
            raise invalid(
                f"{max_tokens_param}: {asked} is over max_output_tokens={self.max_output_tokens}", max_tokens_param
            )
        if asked is None:
            prepared.requests = [r.model_copy(update={"max_tokens": self.max_output_tokens}) for r in prepared.requests]

    def check_characters(
        self, request: GenerateRequest, model: ModelInfo, messages_param: str = "messages", prompt_param: str = "prompt"
    ) -> None:
        """The prompt's text (a chat's messages and tools) within `prompt_characters`: bounded before tokenizing."""
        limit = self.prompt_characters(model)
        characters = prompt_characters(request)
        if characters > limit:
            param = prompt_param if request.prompt is not None else messages_param
            raise invalid(
                f"{param}: {characters} characters are over max_prompt_characters={limit} (the model's context "
                f"holds {model.max_model_len} tokens)",
                param,
            )


def prompt_characters(request: GenerateRequest) -> int:
    """The characters tokenizing `request` reads: its text prompt, or its messages' text and its tools' JSON."""
    if isinstance(request.prompt, str):
        return len(request.prompt) + len(request.suffix or "")
    if request.messages is None:
        return 0  # token ids: nothing to tokenize
    text = sum(
        len(value) if isinstance(value, str) else len(json.dumps(value))
        for message in request.messages
        for value in message.values()
    )
    extras = (request.tools, request.chat_template_kwargs)
    return text + sum(len(json.dumps(extra)) for extra in extras if extra)


def check_vocabulary(request: GenerateRequest, vocab_size: int, prompt_param: str = "prompt") -> None:
    """Token ids and `top_k` within the model's vocabulary, so that no bad value reaches the router or a batch (the
    prompt's ids named as the API calls them: `prompt_param`)."""
    top_k = request.sampling.top_k
    if top_k > vocab_size:
        raise invalid(f"top_k: {top_k} is over the vocabulary's {vocab_size} tokens (0 or -1 keeps them all)", "top_k")
    prompt_ids = request.prompt if isinstance(request.prompt, list) else ()
    outside = token_id_outside(request, prompt_ids, vocab_size)
    if outside is not None:
        param, message = outside
        param = prompt_param if param == "prompt" else param
        raise invalid(f"{param}: {message}", param)
