"""`serve-app bench clients`: real client libraries against running servers, case by case (structured
outputs and tools, as their users call them), side by side; each case's outcome is one of

- `ok`: a call whose arguments match its tool, or an answer of the asked type;
- `length`: the token limit cut the answer, and the server said so in its protocol (whole calls only,
  no half-written call, no format wrapper in the text);
- `malformed`: anything else the server sent back (invalid or cut JSON handed on, leaked wrapper text,
  a call without arguments);
- `error`: the server refused the request (an HTTP error; e.g. a route it does not serve).

The libraries are the test extras' (LangChain, pydantic-ai, the OpenAI Agents SDK) and `instructor`
(`pip install instructor`), imported per case.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from pydantic import BaseModel, ValidationError

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
DESCRIPTION = "The current weather in a city."
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": PARAMETERS}}
ASK_WEATHER = "What is the weather in Paris?"
ASK_PARIS = "Describe Paris in detail."
WIRE = ('"tool_calls"', '"response"', '{"name"', "<tool_call>")


class Place(BaseModel):
    city: str
    description: str


@dataclass(frozen=True)
class Server:
    name: str
    url: str  # without /v1
    model: str


@dataclass(frozen=True)
class Outcome:
    verdict: str  # ok, length, malformed, error
    detail: str


class Length(Exception):
    """The client library reports that the token limit cut the answer."""


def _calls_ok(calls: list[tuple[str, Any]]) -> Outcome:
    """Calls as the library handed them on: each get_weather with a string city."""
    if not calls:
        return Outcome("malformed", "no call")
    if len({json.dumps(a, sort_keys=True) if not isinstance(a, str) else a for _, a in calls}) < len(calls):
        return Outcome("ok", f"{len(calls)} calls, some identical")
    for name, arguments in calls:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
        if name != "get_weather" or not isinstance(value, dict) or not isinstance(value.get("city"), str):
            return Outcome("malformed", f"call {name} {arguments!r}")
    return Outcome("ok", f"{len(calls)} call(s) {calls[0][1]!s:.40}")


def _length_or_malformed(text: str, calls: list) -> Outcome:
    """An answer cut by the limit: clean when it holds no wrapper text and only whole calls."""
    if any(wire in (text or "") for wire in WIRE):
        return Outcome("malformed", f"wrapper in text: {text[:40]!r}")
    if calls and _calls_ok(calls).verdict != "ok":
        return Outcome("malformed", "a cut call handed on")
    return Outcome("length", f"{len(calls)} whole call(s)")


def _openai(server: Server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def openai_parse(server: Server) -> Outcome:
    import openai

    try:
        reply = _openai(server).chat.completions.parse(
            model=server.model, messages=[{"role": "user", "content": ASK_PARIS}], response_format=Place,
            max_tokens=150, temperature=0,
        )
    except openai.LengthFinishReasonError:
        raise Length from None
    parsed = reply.choices[0].message.parsed
    return Outcome("ok", parsed.city) if isinstance(parsed, Place) else Outcome("malformed", "no parsed object")


def openai_json_object(server: Server) -> Outcome:
    choice = _openai(server).chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": ASK_PARIS + " Answer in JSON."}],
        response_format={"type": "json_object"}, max_tokens=100, temperature=0,
    ).choices[0]
    if choice.finish_reason == "length":
        return Outcome("length", f"{len(choice.message.content or '')} characters of JSON so far")
    value = json.loads(choice.message.content or "")
    return Outcome("ok", f"{len(value)} keys") if isinstance(value, dict) else Outcome("malformed", "not an object")


def openai_tools_required(server: Server, max_tokens: int = 60) -> Outcome:
    choice = _openai(server).chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": ASK_WEATHER}], tools=[WEATHER_TOOL],
        tool_choice="required", max_tokens=max_tokens, temperature=0,
    ).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    if choice.finish_reason == "length":
        return _length_or_malformed(choice.message.content or "", calls)
    return _calls_ok(calls)


def openai_tools_streamed(server: Server, max_tokens: int = 60) -> Outcome:
    with _openai(server).chat.completions.stream(
        model=server.model, messages=[{"role": "user", "content": ASK_WEATHER}], tools=[WEATHER_TOOL],
        tool_choice="required", max_tokens=max_tokens, temperature=0,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    if choice.finish_reason == "length":
        return _length_or_malformed(choice.message.content or "", calls)
    return _calls_ok(calls)


def _anthropic(server: Server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def _anthropic_outcome(message) -> Outcome:
    calls = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    text = "".join(b.text for b in message.content if b.type == "text")
    if message.stop_reason == "max_tokens":
        return _length_or_malformed(text, calls)
    return _calls_ok(calls)


def anthropic_tools(server: Server, max_tokens: int = 60) -> Outcome:
    return _anthropic_outcome(_anthropic(server).messages.create(
        model=server.model, max_tokens=max_tokens, messages=[{"role": "user", "content": ASK_WEATHER}],
        tools=[{"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMETERS}],
        tool_choice={"type": "any"}, extra_body={"temperature": 0},
    ))


def anthropic_tools_streamed(server: Server, max_tokens: int = 60) -> Outcome:
    with _anthropic(server).messages.stream(
        model=server.model, max_tokens=max_tokens, messages=[{"role": "user", "content": ASK_WEATHER}],
        tools=[{"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMETERS}],
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0},
    ) as stream:
        message = stream.get_final_message()
    return _anthropic_outcome(message)


def _langchain(server: Server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=server.model, base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=150,
                      max_retries=0)


def langchain_structured_output(server: Server) -> Outcome:
    import openai

    try:
        result = _langchain(server).with_structured_output(Place, method="json_schema").invoke(ASK_PARIS)
    except openai.LengthFinishReasonError:
        raise Length from None
    return Outcome("ok", result.city) if isinstance(result, Place) else Outcome("malformed", repr(result)[:40])


def langchain_bind_tools(server: Server) -> Outcome:
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return city

    message = _langchain(server).bind_tools([get_weather], tool_choice="required").invoke(ASK_WEATHER)
    if message.invalid_tool_calls:
        return Outcome("malformed", f"invalid tool call {message.invalid_tool_calls[0].get('args')!r:.40}")
    if message.response_metadata.get("finish_reason") == "length":
        return _length_or_malformed(str(message.content), [(c["name"], c["args"]) for c in message.tool_calls])
    return _calls_ok([(c["name"], c["args"]) for c in message.tool_calls])


def pydantic_ai_output_type(server: Server) -> Outcome:
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import IncompleteToolCall, UnexpectedModelBehavior
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(server.model, provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key="unused"))
    agent = Agent(model, output_type=Place, model_settings={"temperature": 0, "max_tokens": 150})
    try:
        output = agent.run_sync(ASK_PARIS).output
    except IncompleteToolCall:
        raise Length from None
    except UnexpectedModelBehavior as error:
        if "token limit" in str(error) or "length" in str(error):
            raise Length from None
        raise
    return Outcome("ok", output.city) if isinstance(output, Place) else Outcome("malformed", repr(output)[:40])


def instructor_create(server: Server) -> Outcome:
    import instructor
    from instructor.core.exceptions import IncompleteOutputException

    client = instructor.from_openai(_openai(server), mode=instructor.Mode.JSON_SCHEMA)
    try:
        place = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": ASK_PARIS}], response_model=Place,
            max_tokens=150, temperature=0, max_retries=0,
        )
    except IncompleteOutputException:
        raise Length from None
    return Outcome("ok", place.city)


def agents_sdk(server: Server) -> Outcome:
    import agents
    import openai

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"18 degrees and sunny in {city}"

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        agent = agents.Agent(
            name="weather", instructions="Answer with the weather.", tools=[get_weather], output_type=Place,
            model=agents.OpenAIResponsesModel(model=server.model, openai_client=client),
            model_settings=agents.ModelSettings(temperature=0, max_tokens=150),
        )
        return (await agents.Runner.run(agent, "Describe the weather in Paris.", max_turns=4)).final_output

    try:
        output = asyncio.run(run())
    except agents.exceptions.ModelBehaviorError as error:
        if "incomplete" in str(error) or "max_output_tokens" in str(error):
            raise Length from None
        raise
    return Outcome("ok", output.city) if isinstance(output, Place) else Outcome("malformed", repr(output)[:40])


def responses_tools(server: Server, max_tokens: int = 60) -> Outcome:
    response = _openai(server).responses.create(
        model=server.model, input=ASK_WEATHER, tools=[{"type": "function", "name": "get_weather", "description": DESCRIPTION,
                                                        "parameters": PARAMETERS}],
        tool_choice="required", max_output_tokens=max_tokens, temperature=0,
    )
    calls = [(o.name, o.arguments) for o in response.output if o.type == "function_call"]
    if response.status == "incomplete":
        return _length_or_malformed(response.output_text, calls)
    return _calls_ok(calls)


CASES: dict[str, Callable[[Server], Outcome]] = {
    "OpenAI SDK `chat.completions.parse`": openai_parse,
    "OpenAI SDK `json_object`": openai_json_object,
    "OpenAI SDK tools, `required`": openai_tools_required,
    "OpenAI SDK tools, `required`, max_tokens 35": partial(openai_tools_required, max_tokens=35),
    "OpenAI SDK tools, streamed": openai_tools_streamed,
    "OpenAI SDK tools, streamed, max_tokens 35": partial(openai_tools_streamed, max_tokens=35),
    "Anthropic SDK tools, `any`": anthropic_tools,
    "Anthropic SDK tools, `any`, max_tokens 35": partial(anthropic_tools, max_tokens=35),
    "Anthropic SDK tools, streamed, `tool`": anthropic_tools_streamed,
    "Anthropic SDK tools, streamed, `tool`, max_tokens 20": partial(anthropic_tools_streamed, max_tokens=20),
    "LangChain `with_structured_output`": langchain_structured_output,
    "LangChain `bind_tools`": langchain_bind_tools,
    "pydantic-ai `output_type`": pydantic_ai_output_type,
    "instructor `response_model`": instructor_create,
    "OpenAI Agents SDK, tools + `output_type`": agents_sdk,
    "Responses API tools, `required`": responses_tools,
    "Responses API tools, `required`, max_output_tokens 35": partial(responses_tools, max_tokens=35),
}


def run_case(case: Callable[[Server], Outcome], server: Server) -> Outcome:
    """One case's outcome; what the library raises is classified, never passed on."""
    import anthropic
    import openai

    try:
        return case(server)
    except (Length, openai.LengthFinishReasonError):
        return Outcome("length", "the library reports the token limit")
    except ModuleNotFoundError as error:
        return Outcome("error", f"not installed: {error.name}")
    except (openai.APIStatusError, anthropic.APIStatusError) as error:
        return Outcome("error", f"HTTP {error.status_code}")
    except (ValidationError, json.JSONDecodeError) as error:
        return Outcome("malformed", f"{type(error).__name__}: {str(error).splitlines()[0][:60]}")
    except Exception as error:  # a library failing on what the server sent
        return Outcome("malformed", f"{type(error).__name__}: {str(error).splitlines()[0][:60] if str(error) else ''}")


def run(servers: list[Server]) -> str:
    """Every case against every server, as a markdown table."""
    header = "| case | " + " | ".join(s.name for s in servers) + " |"
    rows = [header, "|" + "---|" * (len(servers) + 1)]
    totals = {s.name: {"ok": 0, "length": 0, "malformed": 0, "error": 0} for s in servers}
    for name, case in CASES.items():
        cells = []
        for server in servers:
            outcome = run_case(case, server)
            totals[server.name][outcome.verdict] += 1
            cells.append(f"{outcome.verdict}: {outcome.detail}".replace("|", "/"))
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    rows.append("| **total** | " + " | ".join(
        ", ".join(f"{count} {verdict}" for verdict, count in totals[s.name].items() if count) for s in servers
    ) + " |")
    return "\n".join(rows)
