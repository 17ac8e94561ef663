"""What a tool-call or harmony constraint compiles from: the generic format's JSON schema, a template format's
xgrammar structural tag (Mistral's built here from xgrammar's tag formats), a harmony model's message stream
(`serve_app.engine.harmony_grammar`)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from serve_app.engine.harmony_grammar import harmony_answer, harmony_calls
from serve_app.wire.requests import StructuredOutput, ToolCallGrammar

if TYPE_CHECKING:
    import xgrammar

# Our tool-call formats as xgrammar's structural-tag builders name them (Mistral's is built here).
_XGRAMMAR_MODEL = {"hermes": "qwen_3", "llama3_json": "llama", "qwen3_coder": "qwen_3_coder", "deepseek_v31": "deepseek_v3_1"}
# Calls in one generic-format answer at most (a small model otherwise repeats a call until `max_tokens`).
MAX_PARALLEL_CALLS = 4


def generic_schema(spec: ToolCallGrammar) -> dict:
    """The generic format's JSON schema: `{"tool_calls": [...]}` (each call's arguments matching its tool),
    or, under `auto`, `{"response": ...}` (a string, or JSON matching the answer's schema)."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in spec.tools
    ]
    most = MAX_PARALLEL_CALLS if spec.parallel else 1
    call_list = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "maxItems": most}
    with_calls = {
        "type": "object", "properties": {"tool_calls": call_list}, "required": ["tool_calls"], "additionalProperties": False,
    }
    if spec.mode != "auto":
        return with_calls
    answer = spec.answer_schema if spec.answer_schema is not None else {"type": "string"}
    plain = {"type": "object", "properties": {"response": answer}, "required": ["response"], "additionalProperties": False}
    return {"anyOf": [with_calls, plain]}


def harmony_tag(spec: StructuredOutput, analysis: bool) -> xgrammar.StructuralTag:
    """`spec` over a harmony model's messages: its calls, or its final message's body."""
    import xgrammar

    if spec.tool_calls is not None:
        return harmony_calls(spec.tool_calls, analysis)
    match spec.kind:
        case "json":
            grammar = xgrammar.Grammar.from_json_schema(json.dumps(spec.json_schema), any_whitespace=False)
        case "json_object":
            grammar = xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        case "regex":
            grammar = xgrammar.Grammar.from_regex(spec.regex)
        case "choice":
            grammar = xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in spec.choice or ()))
        case _:
            grammar = xgrammar.Grammar.from_ebnf(spec.grammar)
    return harmony_answer(str(grammar), analysis)


def _tool_choice(spec: ToolCallGrammar) -> str | dict:
    """xgrammar's `tool_choice` for `spec`: its mode, or the tool it names."""
    if spec.mode == "named":
        return {"type": "function", "function": {"name": spec.tools[0].name}}
    return spec.mode


def structural_tag(spec: ToolCallGrammar | None) -> xgrammar.StructuralTag:
    """The structural tag of `spec`'s format: free text where `auto` allows it (the template's own
    special tokens included), whitespace runs capped inside the arguments; with an answer schema, the
    answer is JSON matching it or calls."""
    import xgrammar
    from xgrammar.structural_tag import JSONSchemaFormat, OrFormat

    assert spec is not None
    tools = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in spec.tools]
    choice = "required" if spec.answer_schema is not None else _tool_choice(spec)
    if spec.format == "mistral":
        tag = _mistral_tag(spec, choice)
    else:
        tag = xgrammar.get_model_structural_tag(
            _XGRAMMAR_MODEL[spec.format],
            tools=tools,
            tool_choice=choice,
            reasoning="disabled",
            exclude_special_tokens=False,
            max_whitespace_cnt=1,
            parallel_tool_calls=spec.parallel,
        )
    if spec.answer_schema is None:
        return tag
    answer = JSONSchemaFormat(json_schema=spec.answer_schema, max_whitespace_cnt=1)
    return tag.model_copy(update={"format": OrFormat(elements=[answer, tag.format])})


def _mistral_tag(spec: ToolCallGrammar, choice: str | dict) -> xgrammar.StructuralTag:
    """Mistral's calls (`[TOOL_CALLS]name[ARGS]{...}`, one after another) as a structural tag: free text before
    them where `auto` allows it, at least one call where `required` or a named tool asks."""
    import xgrammar
    from xgrammar.structural_tag import JSONSchemaFormat, TagFormat, TriggeredTagsFormat

    trigger = "[TOOL_CALLS]"
    tags = [
        TagFormat(
            begin=f"{trigger}{tool.name}[ARGS]",
            content=JSONSchemaFormat(json_schema=tool.parameters, max_whitespace_cnt=1),
            end="",
        )
        for tool in spec.tools
    ]
    if isinstance(choice, dict):  # a named tool: that call, once
        return xgrammar.StructuralTag(format=tags[0])
    calls = TriggeredTagsFormat(
        triggers=[trigger], tags=tags, at_least_one=choice == "required", stop_after_first=not spec.parallel
    )
    return xgrammar.StructuralTag(format=calls)

