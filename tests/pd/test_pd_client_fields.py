"""What clients send, through PD (issue 16 item 4): logit_bias and min_tokens
travel to the decode in the sampling extras, so PD's tokens equal one
engine's; the prompt's logprobs and its cached part come from the prefill's
forward and reach the client's first output. PUSH and PULL."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from disagg.workers.engine.outputs import RequestOutput
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.pd.convert import sampling_extras_metadata, with_sampling_extras
from disagg.workers.pd.messages import NewRequest
from disagg.workers.pd.relay import SERVED_BY_PAIR

PROMPT = [11, 23, 5, 77, 130, 9, 41, 200, 3, 66, 12, 98, 150]


async def _collect(pair: Any, req_id: str, params: SamplingParams) -> list[RequestOutput]:
    return [out async for out in pair.prefill.role.generate(req_id, PROMPT, params)]


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


@pytest.mark.parametrize("mode", ["PUSH", "PULL"])
async def test_logit_bias_and_min_tokens_reach_the_decode(
        pd_pair: Callable[..., Any], reference_tokens: Callable[..., list[int]], mode: str) -> None:
    async with pd_pair(mode) as pair:
        eos = min(pair.prefill.role._engine.engine.stop_checker.eos_token_ids)
        cases = [
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias=((77, 100.0),)),
            # EOS is the likeliest token everywhere, yet only the 5th may be it.
            SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((eos, 100.0),), min_tokens=4),
            SamplingParams(max_tokens=8, temperature=1.0, seed=5, logit_bias=((3, 4.0), (9, -100.0)), min_tokens=2),
        ]
        for i, params in enumerate(cases):
            outputs = await _collect(pair, f"b{i}", params)
            assert outputs[-1].served_by == SERVED_BY_PAIR
            assert _tokens(outputs) == reference_tokens(PROMPT, params), params
        assert _tokens(await _collect(pair, "forced", cases[0])) == [77] * 8
        waited = _tokens(await _collect(pair, "eos", cases[1]))
        assert eos not in waited[:4] and waited[4:] == [eos]


@pytest.mark.parametrize("mode", ["PUSH", "PULL"])
async def test_prompt_logprobs_and_cached_tokens_come_from_the_prefill(
        pd_pair: Callable[..., Any], tiny_model_dir: Path, mode: str) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0, :-1].float(), dim=-1)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    async with pd_pair(mode) as pair:
        plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        await _collect(pair, "warm", plain)  # the prompt's blocks are in the prefill's prefix cache now
        again = await _collect(pair, "again", plain)
        assert again[-1].served_by == SERVED_BY_PAIR and again[-1].num_cached_tokens > 0
        outputs = await _collect(pair, "scored", params)
    assert _tokens(outputs) == _tokens(again)
    given = [out.prompt_logprobs for out in outputs if out.prompt_logprobs is not None]
    assert len(given) == 1 and outputs[0].prompt_logprobs is not None, "once, with the first token"
    entries = given[0]
    assert len(entries) == len(PROMPT) and entries[0] is None
    for position, entry in enumerate(entries[1:]):
        assert entry is not None and entry.token_id == PROMPT[position + 1]
        assert entry.logprob == pytest.approx(reference[position, entry.token_id].item(), abs=1e-4)
        assert entry.top[0][0] == int(reference[position].argmax())


def test_logit_bias_and_min_tokens_travel_in_the_sampling_extras_and_bad_ones_are_refused() -> None:
    params = SamplingParams(max_tokens=6, logit_bias=((5, -100.0), (9, 2.5)), min_tokens=3)
    sent = [NewRequest("a", [1, 2], params, "p:1"), NewRequest("b", [3], SamplingParams(), "p:1")]
    plain = [NewRequest(r.req_id, r.prompt_token_ids, SamplingParams(max_tokens=6), "p:1") for r in sent]
    received = with_sampling_extras(plain, sampling_extras_metadata(sent))
    assert received[0].params == params and received[1].params == SamplingParams(max_tokens=6)
    for bad, words in (({"logit_bias": [[5]]}, "logit_bias must be"), ({"logit_bias": [[5, 300]]}, "between"),
                       ({"min_tokens": "3"}, "integers"), ({"min_tokens": 7}, "min_tokens must be")):
        with pytest.raises(ValueError, match=words):
            with_sampling_extras(plain, (("x-disagg-sampling-extras", json.dumps({"a": bad})),))
