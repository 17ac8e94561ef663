"""StructuredOutput: what a request's output must match (a JSON schema, any JSON object, a regex,
a choice of strings, an EBNF grammar, or the tool calls of a chat template's own format). Plain
pydantic: the HTTP layer builds it, the engine compiles it (`serve_app.engine.grammar`)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app.config import ToolFormat

KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_calls")


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    parameters: dict[str, Any]


class ToolCallGrammar(BaseModel):
    """Tool calls in a tool-call format (the generic JSON one, or a chat template's own), each call's
    arguments matching its tool's schema: `auto` lets the answer be text (or, with `answer_schema`, JSON
    matching it) or calls (in a template's format, after any text); `required` is calls only; `named` is
    one call of the only tool given; `parallel` false ends the output after one call."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: ToolFormat
    tools: list[FunctionTool] = Field(min_length=1)
    mode: Literal["auto", "required", "named"]
    parallel: bool = True
    answer_schema: dict[str, Any] | None = Field(
        None, description="what an answer that calls nothing must match (a JSON schema), `auto` only"
    )

    @model_validator(mode="after")
    def _answer_schema_with_auto(self) -> ToolCallGrammar:
        if self.answer_schema is not None and self.mode != "auto":
            raise ValueError("answer_schema: only an `auto` answer may be other than calls")
        return self


class StructuredOutput(BaseModel):
    """Exactly one constraint. `param` names the client's field it came from, for error messages."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    json_schema: dict[str, Any] | None = Field(None, alias="json")
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    tool_calls: ToolCallGrammar | None = None
    param: str = "structured_output"

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutput:
        given = [name for name, value in self._constraints().items() if value not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}")
        if self.choice is not None and (not self.choice or any(not c for c in self.choice)):
            raise ValueError("choice: give at least one non-empty string")
        return self

    def _constraints(self) -> dict[str, Any]:
        return {
            "json": self.json_schema,
            "json_object": self.json_object,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "tool_calls": self.tool_calls.model_dump() if self.tool_calls is not None else None,
        }

    @property
    def kind(self) -> str:
        return next(name for name, value in self._constraints().items() if value not in (None, False))

    @property
    def is_json(self) -> bool:
        """Whether the answer is JSON or tool calls (what `max_string_tokens` and `max_constrained_tokens` bound)."""
        return self.kind in ("json", "json_object", "tool_calls")

    @property
    def key(self) -> str:
        """A canonical text of the constraint: equal constraints compile once."""
        return json.dumps({self.kind: self._constraints()[self.kind]}, sort_keys=True, separators=(",", ":"))
