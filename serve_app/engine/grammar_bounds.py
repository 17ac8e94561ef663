"""check_size: what a structured-output constraint may cost before it compiles, its text and its JSON schemas'
nesting against `GrammarConfig`. Torch-free, so the HTTP layer refuses an oversized constraint before routing it,
and the engine checks again for requests made in process."""

from __future__ import annotations

from typing import Any

from serve_app.wire.model_card import GrammarConfig
from serve_app.wire.refusals import InvalidRequestError
from serve_app.wire.requests import StructuredOutput


def check_size(spec: StructuredOutput, config: GrammarConfig) -> None:
    """InvalidRequestError naming `spec.param` when the constraint is over `max_grammar_bytes` or a JSON schema in
    it nests deeper than `max_grammar_depth`: what a compile costs grows with both."""
    size = len(spec.key.encode("utf-8"))
    if size > config.max_grammar_bytes:
        raise InvalidRequestError(
            spec.param, f"the constraint has {size} bytes, over max_grammar_bytes={config.max_grammar_bytes}"
        )
    depth = max((_depth(schema) for schema in _schemas(spec)), default=0)
    if depth > config.max_grammar_depth:
        raise InvalidRequestError(spec.param, f"it nests {depth} levels deep, over max_grammar_depth={config.max_grammar_depth}")


def _schemas(spec: StructuredOutput) -> list[Any]:
    """The JSON schemas in a constraint: its own, or its tools' and its answer's."""
    if spec.json_schema is not None:
        return [spec.json_schema]
    if spec.tool_calls is not None:
        answer = spec.tool_calls.answer_schema
        return [tool.parameters for tool in spec.tool_calls.tools] + ([answer] if answer is not None else [])
    return []


def _depth(document: Any) -> int:
    """How deeply JSON objects and arrays nest in `document` (a schema's constraint counts from its own top)."""
    deepest, stack = 0, [(document, 0)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            stack.extend((value, level + 1) for value in node.values())
        elif isinstance(node, list):
            stack.extend((value, level + 1) for value in node)
        else:
            deepest = max(deepest, level)
    return deepest
