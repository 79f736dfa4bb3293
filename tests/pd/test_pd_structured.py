"""Structured outputs through PD (issue 16 item 2): the prefill samples the
first token under the grammar, the grammar travels in our sampling-extras
metadata, and the decode rebuilds the matcher from it and the first token.
Output equals one engine's and validates, PUSH and PULL."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from disagg.workers.engine.grammar import GrammarKind, build_grammar
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.convert import MAX_EXTRAS_BYTES, extras_fit, sampling_extras_metadata, with_sampling_extras
from disagg.workers.pd.messages import NewRequest
from disagg.workers.pd.relay import SERVED_BY_PAIR, SERVED_LOCALLY

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                               "minItems": 2, "maxItems": 3},
                                      "ok": {"type": "boolean"}},
     "required": ["tags", "ok"], "additionalProperties": False},
]
PROMPT = [11, 23, 5, 77, 130, 9]


async def _collect(pair: Any, req_id: str, params: SamplingParams) -> tuple[list[int], str]:
    tokens: list[int] = []
    text = ""
    async for out in pair.prefill.role.generate(req_id, PROMPT, params):
        tokens += out.new_token_ids
        text += out.new_text
    return tokens, text


@pytest.mark.parametrize("mode", ["PUSH", "PULL"])
async def test_constrained_output_through_pd_equals_one_engine_and_validates(
        pd_pair: Callable[..., Any], reference_tokens: Callable[..., list[int]], mode: str) -> None:
    async with pd_pair(mode) as pair:
        for i, schema in enumerate(SCHEMAS):
            grammar = build_grammar(GrammarKind.JSON_SCHEMA, schema)
            for j, params in enumerate((SamplingParams(max_tokens=80, temperature=0.0, grammar=grammar),
                                        SamplingParams(max_tokens=80, temperature=1.0, seed=7, grammar=grammar))):
                tokens, text = await _collect(pair, f"s{i}-{j}", params)
                assert tokens == reference_tokens(PROMPT, params), (schema, params.temperature)
                jsonschema.validate(json.loads(text), schema)


def test_the_grammar_travels_in_the_sampling_extras_and_a_bad_one_is_refused() -> None:
    grammar = build_grammar(GrammarKind.REGEX, "[0-9]{3}")
    sent = [NewRequest("a", [1, 2], SamplingParams(grammar=grammar), "p:1"), NewRequest("b", [3], SamplingParams(), "p:1")]
    plain = [NewRequest(r.req_id, r.prompt_token_ids, SamplingParams(), "p:1") for r in sent]
    received = with_sampling_extras(plain, sampling_extras_metadata(sent))
    assert [r.params.grammar for r in received] == [grammar, None]
    bad = (("x-disagg-sampling-extras", json.dumps({"a": {"grammar": 5}})),)
    with pytest.raises(ValueError, match="grammar must be a string"):
        with_sampling_extras(plain, bad)


# A schema whose grammar (about 43 KB, escaped in JSON) passes gRPC's default metadata
# limits (8 KiB soft, 16 KiB hard): a decode with those refused the call with
# RESOURCE_EXHAUSTED, and the prefill retried for reserve_timeout_s, then failed with a 503.
WIDE_SCHEMA: dict[str, Any] = {
    "type": "object", "properties": {f"field_number_{i}": {"type": "integer", "minimum": 0, "maximum": 9}
                                     for i in range(600)},
    "required": ["field_number_0"], "additionalProperties": False,
}


async def _served(pair: Any, req_id: str, params: SamplingParams) -> tuple[list[int], set[str | None]]:
    tokens: list[int] = []
    by: set[str | None] = set()
    async for out in pair.prefill.role.generate(req_id, PROMPT, params):
        tokens += out.new_token_ids
        by.add(out.served_by)
    return tokens, by


@pytest.mark.parametrize("mode", ["PUSH", "PULL"])
async def test_a_grammar_over_grpcs_default_metadata_limit_is_handed_off(
        pd_pair: Callable[..., Any], reference_tokens: Callable[..., list[int]], mode: str) -> None:
    grammar = build_grammar(GrammarKind.JSON_SCHEMA, WIDE_SCHEMA)
    [(_, extras)] = sampling_extras_metadata([NewRequest("r", PROMPT, SamplingParams(grammar=grammar), "p:1")])
    assert len(extras) > 16 << 10
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, grammar=grammar)
    async with pd_pair(mode) as pair:
        tokens, by = await _served(pair, "wide", params)
    assert by == {SERVED_BY_PAIR}
    assert tokens == reference_tokens(PROMPT, params)


async def test_a_grammar_over_the_metadata_bound_is_served_on_the_prefill(
        pd_pair: Callable[..., Any], reference_tokens: Callable[..., list[int]]) -> None:
    # 1.1 MB of grammar: over what one AddNewRequests call may carry, so no decode could take it.
    grammar = build_grammar(GrammarKind.CHOICE, ["yes", "n" + "o" * (MAX_EXTRAS_BYTES + 1000)])
    params = SamplingParams(max_tokens=6, temperature=0.0, grammar=grammar)
    assert not extras_fit("huge", params)
    async with pd_pair("PUSH", pd=PDConfig(reserve_timeout_s=1.0)) as pair:
        tokens, by = await _served(pair, "huge", params)
        assert by == {SERVED_LOCALLY}
        assert tokens == reference_tokens(PROMPT, params)


def test_extras_over_the_bound_are_refused_before_they_are_sent() -> None:
    fits = SamplingParams(grammar=build_grammar(GrammarKind.REGEX, "a" * (MAX_EXTRAS_BYTES - 1000)))
    assert extras_fit("r", fits)
    assert len(sampling_extras_metadata([NewRequest("r", [1], fits, "p:1")])[0][1]) <= MAX_EXTRAS_BYTES
    # Two such requests in one call do not fit together.
    with pytest.raises(ValueError, match="over the .* bytes of gRPC metadata"):
        sampling_extras_metadata([NewRequest(r, [1], fits, "p:1") for r in ("a", "b")])
