"""The rest of what clients send (issue 16 item 4), on a real mixed worker with
the `openai` client and httpx: echo and prompt logprobs (lm-eval's
loglikelihood requests), batch prompts, logit_bias, min_tokens, logprobs 0,
chat logprob bytes, GET /v1/models/{id}, cached prompt tokens and
stop_token_ids checks.

`served` is conftest's ServedWorker (typed Any: conftest is not importable).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from disagg.workers.engine.tokenizer import Tokenizer

PROMPT = "The capital of France is"
EXACT = {"ignore_eos": True}


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# --- echo and prompt logprobs ---------------------------------------------------------


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client: openai.OpenAI, served: Any,
                                                              tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    for max_tokens in (0, 1):
        r = client.completions.create(model=served.model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                      logprobs=1, echo=True)
        choice = r.choices[0]
        lp = choice.logprobs
        assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
        assert lp.top_logprobs is not None and lp.text_offset is not None
        assert len(lp.tokens) == len(ids) + max_tokens
        assert "".join(lp.tokens[: len(ids)]) == PROMPT and choice.text.startswith(PROMPT)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v is not None and v <= 0.0 for v in lp.token_logprobs[1:])
        assert all(top is not None and len(top) == 1 for top in lp.top_logprobs[1:])
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert r.usage is not None and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == max_tokens
        if max_tokens == 0:
            assert choice.text == PROMPT and choice.finish_reason == "length"
            scored = lp.token_logprobs
        else:
            # The prompt's entries do not depend on what follows; the generated token's is the plain request's.
            assert lp.token_logprobs[: len(ids)] == pytest.approx(scored)
            plain = client.completions.create(model=served.model, prompt=ids, max_tokens=1, temperature=0, logprobs=1)
            assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.token_logprobs is not None
            assert lp.token_logprobs[-1] == pytest.approx(plain.choices[0].logprobs.token_logprobs[0], abs=1e-4)
            assert choice.text == PROMPT + plain.choices[0].text


def test_a_streamed_echo_counts_offsets_from_the_echoed_prompt(served: Any, tokenizer: Tokenizer) -> None:
    """Every chunk's text_offset is a position in the whole text, the echoed prompt first (later
    chunks counted from the end of the prompt's echo, not from 0)."""
    ids = tokenizer.encode(PROMPT)
    body = {"model": served.model, "prompt": ids, "max_tokens": 5, "temperature": 0, "logprobs": 1, "echo": True,
            "stream": True, **EXACT}
    with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=60) as r:
        chunks = [e["choices"][0] for e in _events(r) if e["choices"]]
    assert chunks[0]["text"].startswith(PROMPT) and len(chunks) > 1
    text = ""
    for chunk in chunks:
        offsets = chunk["logprobs"]["text_offset"]
        assert offsets[0] == len(text), (text, chunk)
        text += chunk["text"]
    assert sum(len(c["logprobs"]["tokens"]) for c in chunks) == len(ids) + 5


def test_echo_without_logprobs_and_streamed(http: httpx.Client, client: openai.OpenAI, served: Any,
                                            tokenizer: Tokenizer) -> None:
    r = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                  extra_body=EXACT)
    plain = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=4, temperature=0, extra_body=EXACT)
    assert r.choices[0].text == PROMPT + plain.choices[0].text and r.choices[0].logprobs is None
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2,
            "stream": True, **EXACT}
    with http.stream("POST", "/v1/completions", json=body) as response:
        chunks = [c["choices"][0] for c in _events(response)]
    assert chunks[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in chunks) == r.choices[0].text
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None and chunks[0]["logprobs"]["top_logprobs"][0] is None
    assert len(tokens) == len(tokenizer.encode(PROMPT)) + 4 and "".join(tokens).startswith(PROMPT)


def test_max_tokens_zero_needs_echo(http: httpx.Client, served: Any) -> None:
    response = http.post("/v1/completions", json={"model": served.model, "prompt": PROMPT, "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs_shape(http: httpx.Client, served: Any, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    body = {"model": served.model, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, entry in zip(ids[1:], entries[1:]):
        own = entry[str(token_id)]
        assert own["decoded_token"] == tokenizer.token_text(token_id) and own["logprob"] <= 0.0
        # Its own entry, then the two likeliest (ranks 1 and 2), which may include it.
        assert {1, 2} <= {e["rank"] for e in entry.values()}
        assert len(entry) == (2 if own["rank"] <= 2 else 3)
        assert own["rank"] == 1 + sum(e["logprob"] > own["logprob"] for e in entry.values()) or own["rank"] > 3
    echoed = http.post("/v1/completions", json={**body, "echo": True, "logprobs": 0}).json()["choices"][0]
    assert echoed["logprobs"]["token_logprobs"][1 : len(ids)] == pytest.approx(
        [e[str(t)]["logprob"] for t, e in zip(ids[1:], entries[1:])])
    chat_body = {"model": served.model, "max_tokens": 1, "prompt_logprobs": 1,
                 "messages": [{"role": "user", "content": "Hi"}]}
    chat = http.post("/v1/chat/completions", json=chat_body).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    refused = http.post("/v1/chat/completions", json={**chat_body, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


# --- batch prompts ----------------------------------------------------------------------


def test_batch_prompts_have_indexes_prompt_times_n_plus_j(client: openai.OpenAI, served: Any,
                                                          tokenizer: Tokenizer) -> None:
    prompts = ["The capital of France is", "Hello", "One two three four"]
    alone = [client.completions.create(model=served.model, prompt=p, max_tokens=5, temperature=0, extra_body=EXACT)
             for p in prompts]
    for batch in (prompts, [tokenizer.encode(p) for p in prompts]):
        r = client.completions.create(model=served.model, prompt=batch, max_tokens=5, temperature=0, n=2,
                                      extra_body=EXACT)
        assert sorted(c.index for c in r.choices) == list(range(6))
        for c in r.choices:
            assert c.text == alone[c.index // 2].choices[0].text
        assert r.usage is not None
        assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
        assert r.usage.completion_tokens == 6 * 5


def test_batch_prompts_stream_with_their_indexes(http: httpx.Client, served: Any) -> None:
    body = {"model": served.model, "prompt": ["Hello", "The capital"], "max_tokens": 4, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **EXACT}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = _events(response)
    texts: dict[int, str] = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    whole = http.post("/v1/completions", json={**body, "stream": False, "stream_options": None}).json()
    assert texts == {c["index"]: c["text"] for c in whole["choices"]} and set(texts) == {0, 1}
    assert events[-1]["usage"]["completion_tokens"] == 8


# --- sampling fields --------------------------------------------------------------------


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, served: Any, tokenizer: Tokenizer) -> None:
    forced = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={"77": 100}, extra_body={**EXACT, "return_token_ids": True})
    assert forced.choices[0].model_extra is not None and forced.choices[0].model_extra["token_ids"] == [77] * 4
    free = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=4, temperature=0,
                                     extra_body={**EXACT, "return_token_ids": True})
    first = free.choices[0].model_extra["token_ids"][0]  # type: ignore[index]
    banned = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={str(first): -100}, extra_body={**EXACT, "return_token_ids": True})
    assert first not in banned.choices[0].model_extra["token_ids"]  # type: ignore[index]


@pytest.mark.parametrize("bias", [{"abc": 1}, {"-1": 1}, {"100000": 1}, {"5": 100.5}, {"5": -101}, {"5": "x"}])
def test_bad_logit_bias_is_refused_by_name(http: httpx.Client, served: Any, bias: dict[str, Any]) -> None:
    for path, extra in (("/v1/completions", {"prompt": PROMPT}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        response = http.post(path, json={"model": served.model, "max_tokens": 2, "logit_bias": bias, **extra})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "logit_bias"


def test_min_tokens_holds_back_stop_token_ids(client: openai.OpenAI, served: Any) -> None:
    free = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={**EXACT, "return_token_ids": True})
    ids = free.choices[0].model_extra["token_ids"]  # type: ignore[index]
    stopped = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                        extra_body={**EXACT, "stop_token_ids": [ids[0]], "return_token_ids": True})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].model_extra["token_ids"] == ids[:1]  # type: ignore[index]
    held = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={**EXACT, "stop_token_ids": [ids[0]], "min_tokens": 3,
                                                 "return_token_ids": True})
    assert ids[0] not in held.choices[0].model_extra["token_ids"][:3]  # type: ignore[index]


def test_min_tokens_out_of_range_is_refused(http: httpx.Client, served: Any) -> None:
    response = http.post("/v1/completions", json={"model": served.model, "prompt": PROMPT, "max_tokens": 2,
                                                  "min_tokens": 3})
    assert response.status_code == 400 and response.json()["error"]["param"] == "min_tokens"


def test_logprobs_zero_gives_the_sampled_token(client: openai.OpenAI, served: Any) -> None:
    r = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0,
                                  extra_body=EXACT)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == 3 and all(v is not None and v <= 0.0 for v in lp.token_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text and lp.top_logprobs == [{}, {}, {}]


def test_stop_token_ids_outside_the_vocabulary_are_refused(http: httpx.Client, served: Any) -> None:
    for bad in ([100000], [-1]):
        response = http.post("/v1/completions", json={"model": served.model, "prompt": PROMPT, "max_tokens": 2,
                                                      "stop_token_ids": bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == "stop_token_ids"


def test_chat_logprob_bytes_rebuild_the_text(client: openai.OpenAI, served: Any, tokenizer: Tokenizer) -> None:
    # The byte-level tokenizer splits "é" and "€" into byte tokens: each reports its own byte.
    euro = tokenizer.encode("€")
    assert len(euro) > 1 and tokenizer.token_bytes(euro[0]) == "€".encode()[:1]
    assert b"".join(tokenizer.token_bytes(t) for t in euro) == "€".encode()
    r = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                       temperature=0, logprobs=True, top_logprobs=2, logit_bias={str(euro[0]): 5},
                                       extra_body=EXACT)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    rebuilt = b"".join(bytes(e.bytes or []) for e in content).decode("utf-8", errors="replace")
    assert rebuilt == r.choices[0].message.content
    assert all(t.bytes is not None for e in content for t in e.top_logprobs)


# --- models and usage -------------------------------------------------------------------


def test_model_card_and_openai_404_for_an_unknown_model(client: openai.OpenAI, http: httpx.Client,
                                                        served: Any) -> None:
    card = client.models.retrieve(served.model)
    assert card.id == served.model and card.object == "model"
    response = http.get("/v1/models/no-such-model")
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "The model 'no-such-model' does not exist",
                                         "type": "invalid_request_error", "param": None, "code": "model_not_found"}}


def test_usage_counts_cached_prompt_tokens(client: openai.OpenAI, served: Any) -> None:
    prompt = "A prompt long enough to fill a few blocks of the prefix cache, " * 3
    first = client.completions.create(model=served.model, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=served.model, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and again.usage is not None
    assert again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 0 < cached < again.usage.prompt_tokens


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(http: httpx.Client, served: Any,
                                                                      path: str) -> None:
    prompt: dict[str, Any] = {"prompt": ["Hello", "The capital of"]} if "chat" not in path else \
        {"messages": [{"role": "user", "content": "Hello"}]}
    body = {"model": served.model, **prompt, "max_tokens": 4, "n": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **EXACT}
    with http.stream("POST", path, json=body) as response:
        events = _events(response)
    whole = http.post(path, json={**body, "stream": False, "stream_options": None}).json()
    made: dict[int, int] = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        usage = event["usage"]
        assert usage["completion_tokens"] >= made.get(choice["index"], 0)  # it only grows
        made[choice["index"]] = usage["completion_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert made == {c["index"]: 4 for c in whole["choices"]}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4 * len(made)
    prompts = {event["usage"]["prompt_tokens"] for event in events[:-1]}
    assert sum(prompts) == whole["usage"]["prompt_tokens"]  # each prompt's own count (two differ, one chat)
