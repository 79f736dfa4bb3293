"""The `openai` package, as a real client, against a real mixed worker.

`served` is conftest's ServedWorker (typed Any: conftest is not importable).
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from disagg.workers.engine.tokenizer import Tokenizer

PROMPT = "The capital of France is"
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello world! How are you today?"}]
# Random weights rarely pick the eos token, but ignore it so lengths are exact.
EXACT = {"ignore_eos": True}


def test_models_lists_the_served_name(client: openai.OpenAI, served: Any) -> None:
    assert [m.id for m in client.models.list().data] == [served.model]


def test_completion_usage_and_length(client: openai.OpenAI, served: Any) -> None:
    r = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=7, temperature=0, extra_body=EXACT)
    assert r.object == "text_completion"
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7 and r.usage.prompt_tokens > 0


def test_prompt_as_token_ids_equals_prompt_as_text(client: openai.OpenAI, served: Any, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=EXACT)
    by_ids = client.completions.create(model=served.model, prompt=ids, max_tokens=8, temperature=0, extra_body=EXACT)
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_return_token_ids_decode_to_the_text(client: openai.OpenAI, served: Any, tokenizer: Tokenizer) -> None:
    r = client.completions.create(
        model=served.model, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={**EXACT, "return_token_ids": True}
    )
    token_ids = r.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert len(token_ids) == 6
    assert tokenizer.decode(token_ids) == r.choices[0].text


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI, served: Any) -> None:
    whole = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=10, temperature=0, extra_body=EXACT)
    chunks = list(
        client.completions.create(
            model=served.model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=EXACT,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_whole_and_streamed(client: openai.OpenAI, served: Any) -> None:
    whole = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=9, temperature=0, extra_body=EXACT)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == 9
    stream = client.chat.completions.create(
        model=served.model, messages=CHAT, max_tokens=9, temperature=0, stream=True, extra_body=EXACT
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_are_distinct_and_seeded(client: openai.OpenAI, served: Any) -> None:
    def sample() -> list[str]:
        r = client.completions.create(
            model=served.model, prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=1234, extra_body=EXACT
        )
        assert sorted(c.index for c in r.choices) == [0, 1, 2]
        assert r.usage is not None and r.usage.completion_tokens == 24
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample()
    assert sample() == first  # the same seed gives the same choices
    assert len(set(first)) > 1  # choice i samples with seed + i


def test_n_choices_stream(client: openai.OpenAI, served: Any) -> None:
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in client.chat.completions.create(
        model=served.model, messages=CHAT, max_tokens=5, n=2, temperature=1.0, seed=7, stream=True, extra_body=EXACT
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert all(texts.values())


def test_completion_logprobs(client: openai.OpenAI, served: Any) -> None:
    r = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, extra_body=EXACT)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0.0 for v in lp.token_logprobs)
    for top, chosen in zip(lp.top_logprobs, lp.token_logprobs):
        assert 1 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) == pytest.approx(chosen, abs=1e-4)


def test_chat_logprobs(client: openai.OpenAI, served: Any) -> None:
    r = client.chat.completions.create(
        model=served.model, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, extra_body=EXACT
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for entry in content:
        assert entry.logprob <= 0.0
        assert 1 <= len(entry.top_logprobs) <= 2
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_stop_string_cuts_the_text(client: openai.OpenAI, served: Any) -> None:
    free = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=EXACT)
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"the random model's text {text!r} is too short to cut"
    cut = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], extra_body=EXACT)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_health_answers_while_a_long_stream_runs(served: Any, http: httpx.Client) -> None:
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 64, "temperature": 0, "stream": True, **EXACT}
    with httpx.Client(base_url=served.base_url, timeout=60.0) as streamer:
        with streamer.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            # The stream is mid-flight: the event loop must still answer.
            assert http.get("/health").status_code == 200
            assert http.get("/ready").status_code == 200
            rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"


def test_text_content_parts_equal_plain_content(client: openai.OpenAI, served: Any) -> None:
    parts: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": [{"type": "text", "text": "Hello world! "}, {"type": "text", "text": "How are you today?"}]}
    ]
    with_parts = client.chat.completions.create(model=served.model, messages=parts, max_tokens=6, temperature=0, extra_body=EXACT)
    plain = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=6, temperature=0, extra_body=EXACT)
    assert with_parts.usage is not None and plain.usage is not None
    assert with_parts.usage.prompt_tokens == plain.usage.prompt_tokens
    assert with_parts.choices[0].message.content == plain.choices[0].message.content
