"""A tool-mode answer is read as it is written, in every tool-call format: its text as it comes (held
back only while it may still start a call), each call once its arguments are whole; however the text
is cut into deltas, the events add up to what the finished answer reads as. A cut answer keeps its
whole calls and drops the rest, never showing the format's wrapper; a call repeating an earlier one
ends the answer. Reading is linear in the answer's length."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.answers.scanning import JsonScanner
from serve_app.http.tools import format_for
from serve_app.http.tools.plan import ParsedOutput, ToolSpec, plan, read_answer, tool_answer_reader
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
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def _constraint(name: str, answer_schema: dict | None = None):
    return format_for(name).constraint(plan([ToolSpec("get_weather", "", {})], "auto"), answer_schema)


def _parse(name: str, text: str, complete: bool = True) -> ParsedOutput:
    return read_answer(_constraint(name), text, complete, "call_")


def _streamed(name: str, pieces: list[str], complete: bool = True) -> tuple[str, list[tuple[str, str]], list]:
    """Feed the answer piece by piece, then finish it; what the events add up to."""
    stream = ToolStream(tool_answer_reader(_constraint(name)), "call_")
    events = [event for piece in pieces for event in stream.feed(piece)]
    events += stream.finish(complete)
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
    parsed = _parse(name, text)
    assert [(n, json.loads(a)) for n, a in calls] == [(c.name, json.loads(c.arguments)) for c in parsed.calls]
    assert (content.strip(" \n;") or None if calls else content) == parsed.content


@pytest.mark.parametrize("name,text", CASES)
def test_text_streams_as_it_comes_and_each_call_once_whole(name: str, text: str) -> None:
    stream = ToolStream(tool_answer_reader(_constraint(name)), "call_")
    seen: list[tuple[int, object]] = []
    for index, char in enumerate(text):  # one character per delta
        seen += [(index, event) for event in stream.feed(char)]
    calls = [(i, e) for i, e in seen if isinstance(e, CallStarted)]
    if calls:
        assert calls[0][0] < len(text) - 20  # the first call comes before the answer ends
        arguments = [e for _, e in seen if isinstance(e, ArgumentsDelta)]
        assert len(arguments) == len(calls) and all(json.loads(a.text) for a in arguments)  # each one whole
    else:
        assert sum(isinstance(e, TextDelta) for _, e in seen) > 5  # text as it comes, not once at the end


def test_text_waits_only_while_it_may_still_start_a_call() -> None:
    stream = ToolStream(tool_answer_reader(_constraint("hermes")), "call_")
    assert stream.feed("Checking. <tool_c") == [TextDelta("Checking. ")]
    assert stream.feed('all>\n{"name": "get_wea') == []
    assert stream.feed('ther", "arguments": {"ci') == []  # a call shows only once its arguments are whole
    started = stream.feed('ty": "Paris"}}\n</tool_call>')
    assert [type(e) for e in started] == [CallStarted, ArgumentsDelta] and started[0].name == "get_weather"
    assert started[0].id.startswith("call_") and started[1] == ArgumentsDelta(0, '{"city": "Paris"}')
    assert stream.called
    plain = ToolStream(tool_answer_reader(_constraint("hermes")), "call_")
    assert plain.feed("a <tool_c") == [TextDelta("a ")]
    assert plain.feed("abinet>") + plain.finish(True) == [TextDelta("<tool_cabinet>")]
    answer = ToolStream(tool_answer_reader(_constraint("generic")), "call_")
    assert answer.feed('{"response": "caf\\u00') == [TextDelta("caf")]  # half an escape waits
    assert answer.feed('e9 ok"}') + answer.finish(True) == [TextDelta("é ok")]


@pytest.mark.parametrize(
    "name,whole,cut",
    [
        ("generic", '{"tool_calls":[' + WEATHER + ",", '{"name":"get_weather","arguments":{"city":"Ro'),
        ("hermes", "Sure.\n<tool_call>\n" + WEATHER + "\n</tool_call>\n", '<tool_call>\n{"name": "get_weather", "argum'),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; ', '{"name": "get_weather", "parameters": {"ci'),
    ],
)
def test_a_cut_answer_keeps_its_whole_calls_and_drops_the_cut_one(name: str, whole: str, cut: str) -> None:
    text = whole + cut
    for parsed in (_parse(name, text, complete=False), _parse(name, cut if name != "generic" else '{"tool_calls":[' + cut, False)):
        assert all(c.name == "get_weather" for c in parsed.calls)
        assert not any(marker in (parsed.content or "") for marker in ("{", "<tool_call", "tool_calls", "arguments"))
    assert [json.loads(c.arguments) for c in _parse(name, text, complete=False).calls] == [{"city": "Paris"}]
    content, calls, _ = _streamed(name, list(text), complete=False)
    assert [json.loads(a) for _, a in calls] == [{"city": "Paris"}] and "{" not in content


def test_a_cut_text_answer_is_text_and_a_cut_wrapper_is_nothing() -> None:
    assert _parse("generic", '{"response": "The weather is sunny and', complete=False).content == "The weather is sunny and"
    assert _parse("generic", '{"respo', complete=False) == ParsedOutput((), "")
    assert _parse("generic", '{"tool_calls":[{"name":"get_wea', complete=False) == ParsedOutput((), "")
    assert _parse("hermes", "It is sunny <tool_ca", complete=False).content == "It is sunny "


@pytest.mark.parametrize("name,call,separator", [
    ("generic", '{"name":"get_weather","arguments":{"city":"Paris"}}', ","),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "\n"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "; "),
])
def test_a_call_repeating_an_earlier_one_ends_the_answer(name: str, call: str, separator: str) -> None:
    other = call.replace("Paris", "Rome")
    start = '{"tool_calls":[' if name == "generic" else ""
    reader = tool_answer_reader(_constraint(name))
    parts = reader.feed(start + call + separator + other + separator)
    assert not reader.repeated and len(parts) == 2
    assert reader.feed(call.replace('"Paris"', ' "Paris" ')) == [] and reader.repeated  # the same arguments
    assert reader.feed(separator + call.replace("Paris", "Oslo")) == [] and reader.finish(True) == []


def test_with_an_answer_schema_a_generic_answer_is_its_json() -> None:
    constraint = _constraint("generic", {"type": "object"})
    assert read_answer(constraint, '{"response":{"city":"Paris","n":[1,2]}}', True, "call_").content == '{"city":"Paris","n":[1,2]}'


def test_reading_is_linear_in_the_answers_length() -> None:
    """A 2,000-token call (about 8,000 characters) fed a token at a time, against one four times as long."""

    def seconds(characters: int) -> float:
        text = '{"tool_calls":[{"name":"get_weather","arguments":{"notes":"' + "word " * (characters // 5) + '"}}]}'
        stream = ToolStream(tool_answer_reader(_constraint("generic")), "call_")
        began = time.perf_counter()
        for at in range(0, len(text), 4):
            stream.feed(text[at : at + 4])
        stream.finish(True)
        assert stream.called
        return time.perf_counter() - began

    seconds(2000)  # warm up
    short, long = min(seconds(8000) for _ in range(3)), min(seconds(32000) for _ in range(3))
    assert long < 8 * short, (short, long)  # quadratic reading would take 16 times as long


def test_the_json_scanner_finds_where_a_value_ends() -> None:
    for text, end in [('{"a": "}"} tail', 10), ('"x\\"y" ', 6), ("[1, [2]],", 8), ("12 ", 2)]:
        assert JsonScanner().feed(text) == end
    scanner = JsonScanner()
    assert scanner.feed('{"a": "b\\') is None and scanner.in_string and scanner.escaped
    assert scanner.feed('"c"}') == 4 and scanner.ended
