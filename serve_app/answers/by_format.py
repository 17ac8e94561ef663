"""The reader of an answer, by its constraint: a tool-call format's, or a JSON answer's."""

from __future__ import annotations

from serve_app.answers.generic import GenericReader
from serve_app.answers.harmony import HarmonyReader
from serve_app.answers.reader import AnswerReader, JsonAnswerReader
from serve_app.answers.template import TEMPLATE_FORMATS, TemplateReader
from serve_app.answers.xml_calls import XmlCallReader
from serve_app.wire.requests import StructuredOutput, ToolCallGrammar


def tool_reader(spec: ToolCallGrammar) -> AnswerReader:
    """A reader of answers in `spec`'s format."""
    if spec.format == "generic":
        return GenericReader(json_answer=spec.answer_schema is not None)
    if spec.format == "qwen3_coder":
        return XmlCallReader({tool.name: tool.parameters for tool in spec.tools})
    if spec.format == "openai":
        return HarmonyReader()
    return TemplateReader(*TEMPLATE_FORMATS[spec.format])


def reader_for(spec: StructuredOutput) -> AnswerReader | None:
    """A reader of answers under `spec`, where they are JSON or tool calls (None for a regex, choice or grammar)."""
    if spec.tool_calls is not None:
        return tool_reader(spec.tool_calls)
    return JsonAnswerReader() if spec.is_json else None
