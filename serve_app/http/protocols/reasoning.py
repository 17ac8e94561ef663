"""What each API's reasoning controls ask of the engine: OpenAI's `reasoning_effort` and Responses'
`reasoning.effort`, vLLM's `thinking_token_budget`, Anthropic's `thinking`, as a thinking budget in tokens and the chat template's
`enable_thinking` (gpt-oss's template: `reasoning_effort`, its "Reasoning:" line). A model without a `reasoning_parser`
refuses them by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from serve_app.http.protocols.errors import invalid
from serve_app.wire.model_card import ModelInfo

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
# The thinking budget each effort buys (None: up to the output's own limit); none and minimal do not think.
EFFORT_BUDGET: dict[str, int | None] = {"none": 0, "minimal": 0, "low": 1024, "medium": 4096, "high": None, "xhigh": None}
# The efforts gpt-oss's template names in its system message.
HARMONY_EFFORTS = ("low", "medium", "high")


@dataclass(frozen=True)
class Thinking:
    """How long a request may think: a budget in tokens (None: no budget of its own; 0: not at all), and the effort
    a harmony model's template is told (low, medium, high)."""

    budget: int | None = None
    template_effort: str | None = None

    def template_kwargs(self, asked: dict[str, Any] | None) -> dict[str, Any] | None:
        """The chat template's variables: the client's, `enable_thinking: false` where the budget is nothing (a
        template that reads it, Qwen3's, then closes the span in the prompt), and gpt-oss's `reasoning_effort`."""
        ours: dict[str, Any] = {}
        if self.budget == 0:
            ours["enable_thinking"] = False
        if self.template_effort is not None:
            ours["reasoning_effort"] = self.template_effort
        if not ours:
            return asked
        return {**ours, **(asked or {})}


def from_effort(model: ModelInfo, effort: Effort | None, param: str, budget: int | None = None) -> Thinking:
    """An OpenAI effort as a thinking budget, or vLLM's `thinking_token_budget` as it is."""
    if budget is not None:
        if effort is not None:
            raise invalid(f"thinking_token_budget: give it or {param}, not both", "thinking_token_budget")
        reasoning_model(model, "thinking_token_budget")
        return Thinking(budget)
    if effort is None:
        return Thinking()
    reasoning_model(model, param)
    harmony = model.reasoning_parser == "openai_gptoss" and effort in HARMONY_EFFORTS
    return Thinking(EFFORT_BUDGET[effort], effort if harmony else None)


def reasoning_model(model: ModelInfo, param: str) -> None:
    """Refuses `param` where the model does not reason."""
    if model.reasoning_parser is None:
        raise invalid(f"{param}: this model does not reason (its engine has no reasoning_parser)", param)
