"""OpenAI's Agents SDK against a worker's /v1/responses: a check from outside, not a test.

The SDK is not a dependency of the project; install it beside, in an environment
of its own, and point it at a running prefill or mixed worker:

    python3.11 -m venv /tmp/agents-venv && /tmp/agents-venv/bin/pip install openai-agents
    .venv/bin/disagg serve --role mixed --model builtin:smollm2-135m --http-port 8000 &
    /tmp/agents-venv/bin/python hack/agents_sdk_check.py --base-url http://127.0.0.1:8000/v1

An agent with one function tool runs two turns, whole and streamed: the model
must call the tool (tool_choice names it, so the call is enforced whatever the
model), the SDK runs it and sends the result back as a function_call_output
item, and the model answers. Exits 1 if a run did not call the tool with an
argument or ended without a final answer.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI


async def check(base_url: str, model_name: str) -> bool:
    set_tracing_disabled(True)  # no export to OpenAI's platform
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"sunny, 21 C in {city}"

    model = OpenAIResponsesModel(model=model_name, openai_client=AsyncOpenAI(base_url=base_url, api_key="unused"))
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="get_weather", max_tokens=60, temperature=0),
                  reset_tool_choice=True)  # the second turn may answer in text
    whole = await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
    print(f"run: tool called with {cities}, items {[type(i).__name__ for i in whole.new_items]}, "
          f"final {whole.final_output!r}")
    ok = bool(cities) and bool(whole.final_output)
    cities.clear()
    streamed = Runner.run_streamed(agent, "Weather in Rome?", max_turns=3)
    events = [event.type async for event in streamed.stream_events()]
    print(f"streamed: tool called with {cities}, {len(events)} events, final {streamed.final_output!r}")
    return ok and bool(cities) and bool(streamed.final_output)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="builtin:smollm2-135m", help="the served model name")
    args = p.parse_args()
    return 0 if asyncio.run(check(args.base_url, args.model)) else 1


if __name__ == "__main__":
    sys.exit(main())
