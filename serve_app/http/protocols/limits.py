"""RequestLimits: the bounds every generation request is held to, each breach a 400 naming its limit."""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.config import ServerConfig
from serve_app.http.protocols.prepared import PreparedRequest
from serve_app.http.protocols.errors import invalid


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 16
    max_stop_sequences: int = 16
    max_stop_length: int = 256
    max_messages: int = 1024
    max_output_tokens: int | None = None
    max_constrained_tokens: int | None = None

    @classmethod
    def from_config(cls, config: ServerConfig) -> RequestLimits:
        return cls(
            max_n=config.max_n,
            max_stop_sequences=config.max_stop_sequences,
            max_stop_length=config.max_stop_length,
            max_messages=config.max_messages,
            max_output_tokens=config.max_output_tokens,
            max_constrained_tokens=config.max_constrained_tokens,
        )

    def apply(
        self,
        prepared: PreparedRequest,
        stop_param: str = "stop",
        max_tokens_param: str = "max_tokens",
        messages_param: str = "messages",
    ) -> None:
        """Check `prepared` against the limits (each error naming the field as the protocol calls it); a
        request without `max_tokens` gets `max_output_tokens`, and a JSON or tool-call answer's constrained
        part `max_constrained_tokens` (its requests are replaced so)."""
        if prepared.choices_per_prompt > self.max_n:
            raise invalid(f"n: {prepared.choices_per_prompt} choices are over max_n={self.max_n}", "n")
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

