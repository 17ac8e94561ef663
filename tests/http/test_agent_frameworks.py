"""Agent frameworks against the server, as their users point them at it: pydantic-ai, LangChain,
LiteLLM and the OpenAI Agents SDK, each on `/v1/chat/completions` with structured output and tools
(the Agents SDK's default model class, on `/v1/responses`, runs in tests/http/test_responses.py).

The embedded 135M model is small; the grammar is what makes each framework's output parse, so
the tests check what the frameworks hand back (typed objects, tool calls that validate), greedy.
"""

from __future__ import annotations

import asyncio
import os
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tests.agent_runs import get_weather
from tests.inprocess import MODEL, InProcessServer

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM reads its model list from disk, not the web


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


ASK = "Which city is the capital of France? Give its name, country and continent."


def test_langchain_structured_output_and_bound_tools(server: InProcessServer) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=120,
                      max_retries=0)
    assert isinstance(chat.with_structured_output(City).invoke(ASK), City)  # response_format json_schema
    assert isinstance(chat.with_structured_output(City, method="function_calling").invoke(ASK), City)
    message = chat.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert [call["name"] for call in message.tool_calls] and all(c["name"] == "get_weather" for c in message.tool_calls)
    assert all(isinstance(call["args"].get("city"), str) for call in message.tool_calls), message.tool_calls


def test_litellm_completion_with_tools_and_a_response_format(server: InProcessServer) -> None:
    import litellm

    common = dict(model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=120)
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather", "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]},
        },
    }
    reply = litellm.completion(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool],
                               tool_choice="required", **common)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and calls[0].function.name == "get_weather"
    assert City.model_validate_json(
        litellm.completion(messages=[{"role": "user", "content": ASK}], response_format=City, **common)
        .choices[0].message.content
    )


def test_openai_agents_sdk_runs_an_agent_with_a_tool_and_an_output_type(server: InProcessServer) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI

    async def run() -> tuple[object, object]:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
        settings = ModelSettings(temperature=0, max_tokens=120)
        typed = Agent(name="geographer", instructions="Answer about cities.", model=model, output_type=City,
                      model_settings=settings)
        weather = Agent(
            name="weather", instructions="Use the tool.", model=model, tools=[function_tool(get_weather)],
            model_settings=ModelSettings(temperature=0, max_tokens=120, tool_choice="required"),
            tool_use_behavior="stop_on_first_tool",
        )
        return (await Runner.run(typed, ASK)).final_output, (await Runner.run(weather, "Weather in Paris?")).final_output

    city, weather = asyncio.run(run())
    assert isinstance(city, City)
    assert isinstance(weather, str) and weather.startswith("18 degrees and sunny in ")  # the tool ran on the model's call


@pytest.mark.parametrize("mode", ["tool", "native"])
def test_pydantic_ai_output_modes(server: InProcessServer, mode: str) -> None:
    """pydantic-ai asks for structured output as a forced tool call (`ToolOutput`) or as a `json_schema`
    response format (`NativeOutput`): both come back typed."""
    from pydantic_ai import Agent, NativeOutput, ToolOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key="unused"))
    output = ToolOutput(City) if mode == "tool" else NativeOutput(City)
    agent = Agent(model, output_type=output, model_settings={"temperature": 0, "max_tokens": 120})
    result = agent.run_sync(ASK)
    assert isinstance(result.output, City)
    assert result.usage.input_tokens > 0  # the server's usage reached the framework
