"""Continuous batching policy, driven without a model: each step's sampled
token is a made-up id."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from disagg.workers.engine.block_manager import BlockManager
from disagg.workers.engine.outputs import FinishReason
from disagg.workers.engine.request import Request, RequestStatus
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.engine.scheduler import Scheduler, SchedulerOutput

BLOCK = 4


def make_scheduler(num_blocks: int = 32, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK), max_num_seqs, budget)


def make_request(rid: str, num_prompt: int, max_tokens: int = 4) -> Request:
    tokens = [hash((rid, i)) % 1000 for i in range(num_prompt)]
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), block_size=BLOCK)


def step(scheduler: Scheduler, max_tokens: int | None = None) -> SchedulerOutput:
    """One engine step with a fake model: finish requests at max_tokens."""
    output = scheduler.schedule(max_tokens)
    sampling = output.sample_mask
    scheduler.update(output)
    for request, samples in zip(output.requests, sampling):
        if samples:
            request.append_token(7)
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
    bm = scheduler.block_manager
    bm.check_integrity(scheduler.requests.values())
    return output


def run_to_completion(scheduler: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished_requests:
        outputs.append(step(scheduler))
        assert len(outputs) < max_steps, "the scheduler made no progress"
    return outputs


@pytest.fixture
def scheduler() -> Iterator[Scheduler]:
    s = make_scheduler()
    yield s
    s.block_manager.check_integrity([])
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_single_request_prefills_then_decodes(scheduler: Scheduler) -> None:
    request = make_request("a", 10, max_tokens=3)
    scheduler.add(request)
    outputs = run_to_completion(scheduler)
    assert [o.num_new_tokens for o in outputs] == [[10], [1], [1]]
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.num_output_tokens == 3


def test_token_budget_chunks_a_long_prompt(scheduler: Scheduler) -> None:
    s = make_scheduler(budget=16)
    request = make_request("long", 40, max_tokens=2)
    s.add(request)
    outputs = run_to_completion(s)
    assert [o.num_new_tokens for o in outputs] == [[16], [16], [8], [1]]
    # Only the chunk that reaches the prompt's end samples.
    assert request.num_output_tokens == 2
    assert all(o.num_tokens <= 16 for o in outputs)


def test_a_steps_cap_narrows_the_budget_and_never_widens_it() -> None:
    s = make_scheduler(budget=16)
    for rid in "abc":
        s.add(make_request(rid, 8, max_tokens=1))
    assert step(s, max_tokens=8).num_new_tokens == [8]  # one prompt fits the cap
    assert step(s, max_tokens=64).num_new_tokens == [8, 8]  # the configured 16 still bounds it
    assert not s.has_unfinished_requests


def test_decodes_go_before_prompt_chunks() -> None:
    s = make_scheduler(budget=8)
    early = make_request("early", 4, max_tokens=10)
    s.add(early)
    step(s)  # early is now decoding
    s.add(make_request("long", 30, max_tokens=1))
    for _ in range(4):
        output = step(s)
        assert output.requests[0] is early and output.num_new_tokens[0] == 1
        assert output.num_tokens <= 8
    run_to_completion(s)
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_max_num_seqs_caps_the_running_set() -> None:
    s = make_scheduler(max_num_seqs=2)
    for i in range(5):
        s.add(make_request(f"r{i}", 3, max_tokens=3))
    output = step(s)
    assert len(output.requests) == 2 and s.num_running == 2 and s.num_waiting == 3
    run_to_completion(s)


def test_admission_is_first_come_first_served() -> None:
    s = make_scheduler(num_blocks=6, budget=64)
    big = make_request("big", 20, max_tokens=1)  # 5 blocks
    s.add(make_request("first", 8, max_tokens=8))  # 2 blocks
    s.add(big)
    s.add(make_request("small", 2, max_tokens=1))
    output = step(s)
    # `big` does not fit next to `first`; `small` would, but must not jump the queue.
    assert [r.request_id for r in output.requests] == ["first"]
    assert [r.request_id for r in s.waiting] == ["big", "small"]
    run_to_completion(s)
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_preemption_recomputes_the_newest_and_everything_finishes() -> None:
    s = make_scheduler(num_blocks=6)
    requests = [make_request(f"r{i}", 7, max_tokens=8) for i in range(3)]  # 2 blocks each, growing to 4
    for request in requests:
        s.add(request)
    outputs = run_to_completion(s)
    preempted = [r for o in outputs for r in o.preempted]
    assert preempted, "the pool is too small for all three: someone must be preempted"
    assert preempted[0] is requests[2], "the newest request goes first"
    for request in requests:
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert request.num_output_tokens == 8
    assert requests[2].num_preemptions >= 1 and requests[0].num_preemptions == 0
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_a_preempted_request_goes_back_to_the_front() -> None:
    s = make_scheduler(num_blocks=4, max_num_seqs=8)
    a = make_request("a", 4, max_tokens=6)
    b = make_request("b", 4, max_tokens=6)
    s.add(a)
    s.add(b)
    step(s)  # both prefilled: 1 block each, full
    s.add(make_request("c", 4, max_tokens=1))  # waits behind them
    for _ in range(8):
        output = step(s)
        if output.preempted:
            assert output.preempted == [b]
            assert s.waiting[0] is b
            break
    else:
        pytest.fail("no preemption happened")
    run_to_completion(s)


def test_abort_frees_blocks_wherever_the_request_is(scheduler: Scheduler) -> None:
    running = make_request("running", 9, max_tokens=50)
    waiting = make_request("waiting", 9, max_tokens=50)
    scheduler.add(running)
    step(scheduler)
    scheduler.add(waiting)
    assert scheduler.block_manager.num_used_blocks > 0
    assert scheduler.abort("running") is running
    assert running.status is RequestStatus.FINISHED_ABORTED and not running.block_table
    assert scheduler.abort("waiting") is waiting
    assert scheduler.abort("unknown") is None
    assert not scheduler.has_unfinished_requests


def test_abort_in_the_middle_of_a_chunked_prefill() -> None:
    s = make_scheduler(budget=8)
    request = make_request("long", 30, max_tokens=4)
    s.add(request)
    step(s)
    assert 0 < request.num_computed_tokens < request.num_prompt_tokens
    s.abort("long")
    s.block_manager.check_integrity([])
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_prefix_cache_hit_skips_computed_tokens(scheduler: Scheduler) -> None:
    first = make_request("a", 10, max_tokens=1)
    scheduler.add(first)
    run_to_completion(scheduler)
    twin = Request("b", first.token_ids[:10] + [3], SamplingParams(max_tokens=1), block_size=BLOCK)
    scheduler.add(twin)
    output = step(scheduler)
    assert twin.num_cached_tokens == 8  # two full blocks
    assert output.num_new_tokens == [3]
    run_to_completion(scheduler)


def test_reserve_then_admit_running_decodes_without_a_prefill(scheduler: Scheduler) -> None:
    request = make_request("r", 9, max_tokens=3)
    assert scheduler.can_reserve(request)
    scheduler.reserve(request)
    # Reserved: owns every prompt block in the one table, but is never scheduled.
    assert request.status is RequestStatus.RESERVED and len(request.block_table) == request.num_blocks
    assert scheduler.requests["r"] is request and not scheduler.has_unfinished_requests
    scheduler.block_manager.check_integrity(scheduler.requests.values())
    assert scheduler.schedule().is_empty
    scheduler.admit_running(request)
    request.append_token(7)  # the first token, sampled where the prompt ran
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == request.num_prompt_tokens
    first = step(scheduler)
    assert first.requests == [request] and first.num_new_tokens == [1]  # a decode step, not a prefill
    run_to_completion(scheduler)
    assert request.status is RequestStatus.FINISHED_LENGTH and "r" not in scheduler.requests


def test_reserve_fails_cleanly_when_blocks_run_out() -> None:
    s = make_scheduler(num_blocks=4)
    s.reserve(make_request("a", 12))
    assert not s.can_reserve(make_request("b", 8))
    assert s.abort("a") is not None  # a reserved request aborts like any other
    assert s.block_manager.num_free_blocks == 4 and not s.requests


def test_hold_keeps_the_blocks_out_of_the_batch_until_release(scheduler: Scheduler) -> None:
    held = make_request("held", 9, max_tokens=50)
    other = make_request("other", 5, max_tokens=2)
    scheduler.add(held)
    scheduler.add(other)
    step(scheduler)
    scheduler.hold(held)
    blocks = list(held.block_table)
    assert held.status is RequestStatus.HELD and held not in scheduler.running
    run_to_completion(scheduler)  # only `other` runs; `held` keeps its blocks meanwhile
    assert held.block_table == blocks and scheduler.requests == {"held": held}
    scheduler.block_manager.check_integrity(scheduler.requests.values())
    scheduler.release(held)
    assert not held.block_table and not scheduler.requests and held.status.is_finished


def test_statuses_map_to_finish_reasons() -> None:
    for reason in FinishReason:
        status = RequestStatus.finished(reason)
        assert status.is_finished and status.finish_reason is reason
    for live in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.RESERVED, RequestStatus.HELD):
        assert not live.is_finished and live.finish_reason is None
