"""Grammars over gpt-oss's harmony message stream (`serve_app.engine.harmony`): at most one analysis message where
thinking is allowed, then the answer the request constrains, a final message or a call to one of its tools.

The markers are asked for as the special tokens they are, never as their spelling in plain tokens (the channels are
read by token id), and the analysis body is not the grammar's: it is left free and the grammar reads only its
markers. A call, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` or the form the
template writes in history (` to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>`), ends the output
(`<|call|>` is an end token): one call per answer, parallel or not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar

    from serve_app.wire.requests import FunctionTool, ToolCallGrammar


def harmony_answer(ebnf: str, analysis: bool) -> xgrammar.StructuralTag:
    """A final message whose body matches `ebnf`, after an analysis message where `analysis` allows one."""
    from xgrammar.structural_tag import GrammarFormat

    return _stream([_final(GrammarFormat(grammar=ebnf))], analysis)


def harmony_calls(spec: ToolCallGrammar, analysis: bool) -> xgrammar.StructuralTag:
    """A call to one of `spec`'s tools, or (under `auto`) a final message: free text, or JSON matching the answer
    schema where there is one; after an analysis message where `analysis` allows one."""
    from xgrammar.structural_tag import AnyTextFormat, JSONSchemaFormat

    answers = [_call(tool) for tool in spec.tools]
    if spec.mode == "auto":
        body = AnyTextFormat() if spec.answer_schema is None else JSONSchemaFormat(json_schema=spec.answer_schema, max_whitespace_cnt=1)
        answers.append(_final(body))
    return _stream(answers, analysis)


def _stream(answers: list[Any], analysis: bool) -> xgrammar.StructuralTag:
    import xgrammar
    from xgrammar.structural_tag import OptionalFormat, OrFormat

    answer = answers[0] if len(answers) == 1 else OrFormat(elements=answers)
    if not analysis:
        return xgrammar.StructuralTag(format=answer)
    thinking = _sequence(_token("<|channel|>"), _text("analysis"), _token("<|message|>"), _token("<|end|>"))
    separator = _sequence(_token("<|start|>"), _text("assistant"))
    return xgrammar.StructuralTag(format=_sequence(OptionalFormat(content=_sequence(thinking, separator)), answer))


def _final(body: Any) -> Any:
    """`<|channel|>final<|message|>` `body` `<|return|>`."""
    from xgrammar.structural_tag import AnyTextFormat, TagFormat

    if isinstance(body, AnyTextFormat):  # free text ends where the end token is written
        ending = TagFormat(begin="", content=body, end="<|return|>")
        return _sequence(_token("<|channel|>"), _text("final"), _token("<|message|>"), ending)
    return _sequence(_token("<|channel|>"), _text("final"), _token("<|message|>"), body, _token("<|return|>"))


def _call(tool: FunctionTool) -> Any:
    """A call to `tool`, in either header form."""
    from xgrammar.structural_tag import JSONSchemaFormat, OrFormat

    arguments = JSONSchemaFormat(json_schema=tool.parameters, max_whitespace_cnt=1)
    channel_first = _sequence(
        _token("<|channel|>"), _text(f"commentary to=functions.{tool.name} "), _token("<|constrain|>"), _text("json"),
        _token("<|message|>"), arguments, _token("<|call|>"),
    )
    recipient_first = _sequence(
        _text(f" to=functions.{tool.name}"), _token("<|channel|>"), _text("commentary json"), _token("<|message|>"),
        arguments, _token("<|call|>"),
    )
    return OrFormat(elements=[channel_first, recipient_first])


def _sequence(*elements: Any) -> Any:
    from xgrammar.structural_tag import SequenceFormat

    return SequenceFormat(elements=list(elements))


def _token(marker: str) -> Any:
    from xgrammar.structural_tag import TokenFormat

    return TokenFormat(token=marker)


def _text(text: str) -> Any:
    from xgrammar.structural_tag import ConstStringFormat

    return ConstStringFormat(value=text)
