"""A tool-mode answer streams as it is written, in every tool-call format: its text as it comes (held
back only while it may still start a call), each call's name once written, its arguments in pieces;
and however the text is cut into deltas, the pieces add up to what the finished answer parses to."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.http.tools import format_for
from serve_app.http.tools.stream import (
    ArgumentsDelta,
    CallStarted,
    TextDelta,
    ToolStream,
)

ANSWERS = {
    "generic": [
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris \\"centre\\"", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET", "nested": {"a": [1, "}"]}}}]}',
        '{"response": "Hello! \\u00e9t\\u00e9 \\ud83d\\ude00 \\\\ done\\n"}',
    ],
    "hermes": [
        'Let me check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "<tool_call>"}}\n</tool_call>',
        "Plain text that mentions <tool_cabinet> and ends.",
    ],
    "llama3_json": [
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"zone": "UTC"}}',
        "Just words, {not a call}.",
    ],
}
CASES = [(name, text) for name, texts in ANSWERS.items() for text in texts]


def _streamed(name: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    """Feed the answer's text so far after each piece, then finish; what the events add up to."""
    stream, text, events = ToolStream(format_for(name), "call_"), "", []
    for piece in pieces:
        text += piece
        events += stream.update(text)
    events += stream.update(text, final=True)
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls = [[e.name, ""] for e in events if isinstance(e, CallStarted)]
    for event in events:
        if isinstance(event, ArgumentsDelta):
            calls[event.call][1] += event.text
    return content, [(n, a) for n, a in calls], events


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_any_cut_into_deltas_adds_up_to_the_parsed_answer(case: tuple[str, str], cuts: list[int]) -> None:
    name, text = case
    bounds = [0, *sorted({c for c in cuts if c < len(text)}), len(text)]
    content, calls, _ = _streamed(name, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    parsed = format_for(name).parse(text, "call_")
    assert [(n, json.loads(a)) for n, a in calls] == [(c.name, json.loads(c.arguments)) for c in parsed.calls]
    assert (content.strip(" \n;") or None if calls else content) == parsed.content


@pytest.mark.parametrize("name,text", CASES)
def test_text_and_arguments_stream_before_the_answer_ends(name: str, text: str) -> None:
    _, calls, events = _streamed(name, list(text))  # one character per delta
    if calls:
        assert sum(isinstance(e, ArgumentsDelta) for e in events) > len(calls)  # arguments in pieces
    else:
        assert sum(isinstance(e, TextDelta) for e in events) > 5  # text as it comes, not once at the end


def test_text_waits_only_while_it_may_still_start_a_call() -> None:
    stream = ToolStream(format_for("hermes"), "call_")
    assert stream.update("Checking. <tool_c") == [TextDelta("Checking. ")]
    assert stream.update('Checking. <tool_call>\n{"name": "get_wea') == []
    started = stream.update('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [type(e) for e in started] == [CallStarted, ArgumentsDelta] and started[0].name == "get_weather"
    assert started[0].id.startswith("call_") and started[1] == ArgumentsDelta(0, '{"ci')
    assert stream.called
    plain = ToolStream(format_for("hermes"), "call_")
    assert plain.update("a <tool_c") == [TextDelta("a ")]
    assert plain.update("a <tool_cabinet>", final=True) == [TextDelta("<tool_cabinet>")]
    answer = ToolStream(format_for("generic"), "call_")
    assert answer.update('{"response": "caf\\u00') == [TextDelta("caf")]  # half an escape waits
    assert answer.update('{"response": "caf\\u00e9 ok"}', final=True) == [TextDelta("é ok")]
