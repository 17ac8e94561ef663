"""An OpenAI Agents SDK run against a server of ours, through the SDK's default model class
(`OpenAIResponsesModel`, which speaks `/v1/responses`): shared by the in-process and serve-run tests."""

from __future__ import annotations

import asyncio

import openai

from tests.inprocess import MODEL


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"18 degrees and sunny in {city}"


def weather_agent_answer(url: str) -> object:
    """What an agent with one function tool, forced to call it and stopping on its result, answers."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI

    async def run() -> object:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        agent = Agent(
            name="weather", instructions="Use the tool.", model=OpenAIResponsesModel(model=MODEL, openai_client=client),
            tools=[function_tool(get_weather)], tool_use_behavior="stop_on_first_tool",
            model_settings=ModelSettings(temperature=0, max_tokens=120, tool_choice="required"),
        )
        return (await Runner.run(agent, "Weather in Paris?")).final_output

    return asyncio.run(run())
