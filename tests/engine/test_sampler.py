"""The sampler's masks, penalties, draws and logprobs, on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from disagg.workers.engine.request import Request
from disagg.workers.engine.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    mask_min_p,
    mask_top_k_top_p,
)
from disagg.workers.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def make_request(params: SamplingParams, prompt: list[int] | None = None, output: tuple[int, ...] = ()) -> Request:
    request = Request("r", prompt or [0], params, block_size=4)
    for token in output:
        request.append_token(token)
    return request


def meta_for(requests: list[Request], vocab: int = 8) -> SamplingMetadata:
    return SamplingMetadata.from_requests(requests, vocab, CPU)


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row != NEG_INF).flatten().tolist() for row in logits]


@pytest.mark.parametrize("temperature", [0.0, 1e-6, 1e-44, 1e-300])
def test_greedy_takes_the_argmax(temperature: float) -> None:
    """Temperatures so small that logits / temperature overflow float32 are greedy too (they drew NaNs: token 0)."""
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, -1.0, 4.9]])
    requests = [make_request(SamplingParams(temperature=temperature, seed=7)) for _ in range(2)]
    out = Sampler(CPU)(logits, meta_for(requests, vocab=3))
    assert out.token_ids == [1, 0]
    assert out.logprobs == [None, None]


def test_top_k_keeps_the_k_best() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    masked = mask_top_k_top_p(logits, torch.tensor([2, 4]), None)
    assert kept(masked) == [[1, 2], [0, 1, 2, 3]]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3)
    masked = mask_top_k_top_p(probs.log(), None, torch.tensor([0.5, 0.8, 1.0]))
    # 0.5 alone reaches 0.5; 0.5 + 0.3 reaches 0.8; p = 1 keeps everything.
    assert kept(masked) == [[0], [0, 1], [0, 1, 2, 3]]


def test_top_p_applies_after_top_k() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # Top-2 renormalises to 4/7, 3/7: top-p 0.5 then keeps only the first.
    masked = mask_top_k_top_p(probs.log(), torch.tensor([2]), torch.tensor([0.5]))
    assert kept(masked) == [[0]]


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    masked = mask_min_p(probs.log(), torch.tensor([0.5, 0.0]))
    assert kept(masked) == [[0, 1], [0, 1, 2, 3]]


def test_draws_never_leave_the_masked_set() -> None:
    logits = torch.zeros(1, 8)
    params = SamplingParams(temperature=1.0, top_k=3)
    logits[0, [2, 5, 7]] = 1.0  # the three best
    sampler = Sampler(CPU, seed=0)
    drawn = {sampler(logits, meta_for([make_request(params)])).token_ids[0] for _ in range(60)}
    assert drawn == {2, 5, 7}


def test_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    requests = [make_request(SamplingParams(temperature=1.0)) for _ in range(4000)]
    out = Sampler(CPU, seed=0)(logits, meta_for(requests, vocab=3))
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_temperature_sharpens_the_distribution() -> None:
    logits = torch.tensor([[1.0, 0.0]]).repeat(2000, 1)
    cold = [make_request(SamplingParams(temperature=0.25)) for _ in range(2000)]
    out = Sampler(CPU, seed=1)(logits, meta_for(cold, vocab=2))
    share = out.token_ids.count(0) / 2000
    expected = 1 / (1 + math.exp(-4.0))  # softmax of [4, 0]
    assert share == pytest.approx(expected, abs=0.03)


def test_a_seed_reproduces_the_draws_whatever_the_batch() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=1.0, seed=42)

    def draw_sequence(batch_rows: int) -> list[int]:
        request = make_request(seeded)
        others = [make_request(SamplingParams(temperature=1.0)) for _ in range(batch_rows - 1)]
        sampler = Sampler(CPU, seed=batch_rows)
        return [
            sampler(logits[: batch_rows], meta_for(others + [request], vocab=50)).token_ids[-1]
            for _ in range(10)
        ]

    alone = draw_sequence(1)
    assert len(set(alone)) > 1, "a temperature-1 draw should vary from step to step"
    # Row content differs with the batch, so compare a row with the same logits.
    logits[2] = logits[0]
    assert draw_sequence(3) == alone


def test_penalties_math() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # Token 0 is in the prompt only; token 1 once and token 2 twice in the output.
    request = make_request(params, prompt=[0], output=(1, 2, 2))
    out = apply_penalties(logits, meta_for([request], vocab=4))
    expected = torch.tensor([[
        2.0 / 2.0,                     # prompt: repetition only
        -2.0 * 2.0 - 0.5 * 1 - 0.25,   # negative logit: multiplied, then frequency and presence
        1.0 / 2.0 - 0.5 * 2 - 0.25,
        0.5,                           # unseen
    ]])
    assert torch.allclose(out, expected)


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.5]])
    plain = make_request(SamplingParams(temperature=0.0), output=(0,))
    penalized = make_request(SamplingParams(temperature=0.0, frequency_penalty=1.0), output=(0,))
    out = Sampler(CPU)(logits.repeat(2, 1), meta_for([plain, penalized], vocab=2))
    assert out.token_ids == [0, 1]


def test_logprobs_match_log_softmax_of_the_raw_logits() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(3))
    requests = [
        make_request(SamplingParams(temperature=0.7, logprobs=3, seed=5, repetition_penalty=1.5), output=(1,)),
        make_request(SamplingParams(temperature=0.0, logprobs=0)),
    ]
    out = Sampler(CPU)(logits, meta_for(requests, vocab=10))
    reference = torch.log_softmax(logits, dim=-1)
    first, second = out.logprobs
    assert first is not None and second is not None
    assert first.logprob == pytest.approx(reference[0, out.token_ids[0]].item(), abs=1e-6)
    top_values, top_ids = reference[0].topk(3)
    assert [t for t, _ in first.top] == top_ids.tolist()
    assert [v for _, v in first.top] == pytest.approx(top_values.tolist(), abs=1e-6)
    assert second.top == () and second.token_id == int(logits[1].argmax())
