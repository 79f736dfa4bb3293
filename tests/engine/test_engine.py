"""The whole engine on tiny random models: against transformers, and against
itself under chunking, preemption, prefix caching and batching."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from disagg.testing.tiny_model import FAMILIES
from disagg.workers.engine.async_engine import AsyncEngine, EngineError, EngineStats
from disagg.workers.engine.config import EngineConfig, cpu_has_native_bf16
from disagg.workers.engine.llm_engine import LLMEngine, OutOfBlocks, PromptTooLarge
from disagg.workers.engine.outputs import FinishReason, RequestOutput
from disagg.workers.engine.sampling_params import SamplingParams

torch.set_num_threads(2)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
MakeEngine = Callable[..., LLMEngine]


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def final(self) -> RequestOutput:
        return self.outputs[-1]


def prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[Result]:
    """Submit all requests at once and step until every one finishes."""
    results = {f"r{i}": Result() for i in range(len(requests))}
    for (rid, _), (prompt, params) in zip(results.items(), requests):
        engine.add_request(rid, prompt, params)
    steps = 0
    while engine.has_unfinished_requests:
        for out in engine.step():
            result = results[out.request_id]
            assert not (result.outputs and result.final.finished), "output after the final one"
            result.token_ids += out.new_token_ids
            result.text += out.new_text
            result.outputs.append(out)
        steps += 1
        assert steps < 2000, "the engine made no progress"
    engine.check_integrity()
    return list(results.values())


def tokens(results: list[Result]) -> list[list[int]]:
    return [r.token_ids for r in results]


@pytest.fixture
def make_engine(tiny_model: Callable[..., Path]) -> Iterator[MakeEngine]:
    """Builds engines on a tiny model; after the test, each one's pool is whole again."""
    engines: list[tuple[LLMEngine, int]] = []

    def make(family: str = "llama", **overrides: object) -> LLMEngine:
        settings: dict[str, object] = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=128)
        settings.update(overrides)
        engine = LLMEngine.from_config(EngineConfig(model=str(tiny_model(family)), **settings))  # type: ignore[arg-type]
        engines.append((engine, engine.num_free_blocks))
        return engine

    yield make
    for engine, free_at_start in engines:
        assert not engine.has_unfinished_requests
        engine.check_integrity()
        assert engine.num_free_blocks == free_at_start == engine.num_total_blocks


# --- against transformers ------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_generate(family: str, make_engine: MakeEngine, tiny_model: Callable[..., Path]) -> None:
    import transformers

    # Lengths at and around the block size (4) and its multiples.
    batch = prompts(6, [3, 4, 5, 8, 9, 17], seed=1)
    engine = make_engine(family)
    ours = tokens(run(engine, [(p, GREEDY) for p in batch]))

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model(family), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the engine ignores eos here too
    for prompt, got in zip(batch, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                              pad_token_id=0)
        assert got == out[0, len(prompt):].tolist()


# --- the engine against itself ------------------------------------------------------


def test_concurrent_batch_equals_one_at_a_time(make_engine: MakeEngine) -> None:
    batch = prompts(7, [1, 6, 13, 4, 21, 2, 9], seed=2)
    engine = make_engine()
    together = tokens(run(engine, [(p, GREEDY) for p in batch]))
    alone = [tokens(run(engine, [(p, GREEDY)]))[0] for p in batch]
    assert together == alone


def test_chunked_prefill_gives_identical_outputs(make_engine: MakeEngine) -> None:
    batch = prompts(3, [30, 23, 11], seed=3)
    whole = tokens(run(make_engine(), [(p, GREEDY) for p in batch]))
    chunked_engine = make_engine(max_num_batched_tokens=7)
    chunked = run(chunked_engine, [(p, GREEDY) for p in batch])
    assert tokens(chunked) == whole
    # The longest prompt really came in several chunks: no output until it was done.
    assert chunked[0].outputs[0].num_output_tokens == 1


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_and_recompute_give_identical_outputs(make_engine: MakeEngine, prefix_caching: bool) -> None:
    batch = prompts(5, [10, 7, 12, 5, 9], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    roomy = tokens(run(make_engine(), [(p, params) for p in batch]))
    tight = make_engine(num_kv_blocks=16, enable_prefix_caching=prefix_caching)
    assert tokens(run(tight, [(p, params) for p in batch])) == roomy
    assert tight.scheduler.num_preemptions > 0, "the pool was meant to be too small"


def test_prefix_cache_hits_share_blocks_and_keep_outputs(make_engine: MakeEngine) -> None:
    shared = prompts(1, [16], seed=5)[0]
    batch = [shared + tail for tail in prompts(3, [3, 5, 1], seed=6)]
    reference = tokens(run(make_engine(enable_prefix_caching=False), [(p, GREEDY) for p in batch]))

    engine = make_engine()
    first = run(engine, [(batch[0], GREEDY)])
    rest = run(engine, [(p, GREEDY) for p in batch[1:]])
    assert tokens(first + rest) == reference
    assert first[0].final.num_cached_tokens == 0
    assert [r.final.num_cached_tokens for r in rest] == [16, 16]
    assert engine.block_manager.num_cache_hit_blocks == 8


def test_seeded_sampling_is_reproducible_whatever_the_batch(make_engine: MakeEngine) -> None:
    prompt = prompts(1, [6], seed=7)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    engine = make_engine()
    alone = tokens(run(engine, [(prompt, seeded)]))[0]
    noise = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    mixed = run(engine, [(p, noise) for p in prompts(3, [4, 9], seed=8)] + [(prompt, seeded)])
    assert mixed[-1].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=4321, ignore_eos=True)
    assert tokens(run(engine, [(prompt, other_seed)]))[0] != alone


# --- finishing --------------------------------------------------------------------


def test_abort_at_any_point_frees_blocks(make_engine: MakeEngine) -> None:
    engine = make_engine(max_num_batched_tokens=8, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(prompts(3, [20, 5, 5], seed=9)):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # r0 mid-prefill, r1 admitted, r2 waiting
    assert engine.scheduler.requests["r0"].is_prefill
    engine.step()
    engine.step()
    for rid in ("r0", "r1", "r2"):
        assert engine.abort_request(rid)
    assert not engine.abort_request("r0")
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == ["r0", "r1", "r2"]
    assert all(o.finished and o.finish_reason == "abort" for o in outputs)
    assert not engine.has_unfinished_requests
    assert engine.num_free_blocks == engine.num_total_blocks


def test_stop_strings_cut_the_text_and_never_leak(make_engine: MakeEngine) -> None:
    engine = make_engine()
    prompt = engine.tokenizer.encode("The capital of France is")  # type: ignore[union-attr]
    free_run = run(engine, [(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))])[0]
    text = free_run.text
    assert len(text) > 6, f"need some text to cut: {text!r}"
    stop = text[3:6]
    cut_at = text.index(stop)
    stopped = run(engine, [(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                   stop=(stop, "\u2603never")))])[0]
    assert stopped.text == text[:cut_at]
    assert stopped.final.finish_reason == "stop" and stopped.final.stop_reason == stop
    # No streamed delta ever held text past the cut.
    assert all(stop not in o.new_text for o in stopped.outputs)


def test_stop_token_ids_and_max_tokens(make_engine: MakeEngine) -> None:
    engine = make_engine()
    prompt = prompts(1, [5], seed=10)[0]
    free_run = run(engine, [(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))])[0]
    assert len(free_run.token_ids) == 6 and free_run.final.finish_reason == "length"
    stop_id = free_run.token_ids[2]
    first = free_run.token_ids.index(stop_id)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop_token_ids=(stop_id,))
    stopped = run(engine, [(prompt, params)])[0]
    assert stopped.token_ids == free_run.token_ids[: first + 1]
    assert stopped.final.finish_reason == "stop" and stopped.final.stop_reason == stop_id


def test_context_length_finishes_with_length(make_engine: MakeEngine) -> None:
    engine = make_engine(max_model_len=12)
    result = run(engine, [(prompts(1, [9])[0], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))])[0]
    assert len(result.token_ids) == 3 and result.final.finish_reason == "length"


def test_logprobs_are_reported_for_every_token(make_engine: MakeEngine) -> None:
    engine = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    result = run(engine, [(prompts(1, [7])[0], params)])[0]
    logprobs = [lp for o in result.outputs for lp in (o.new_logprobs or [])]
    assert [lp.token_id for lp in logprobs] == result.token_ids
    for lp in logprobs:
        assert len(lp.top) == 3
        # Greedy: the sampled token is the most likely one.
        assert lp.top[0][0] == lp.token_id and lp.top[0][1] == pytest.approx(lp.logprob)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_bad_requests_are_refused_with_clear_errors(make_engine: MakeEngine) -> None:
    engine = make_engine(max_model_len=16)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("a", [1, 10**6], GREEDY)
    with pytest.raises(ValueError, match="context"):
        engine.add_request("a", list(range(3, 19)), GREEDY)
    with pytest.raises(ValueError, match="logit_bias token ids"):
        engine.add_request("a", [5, 6], dataclasses.replace(GREEDY, logit_bias=((10**6, 1.0),)))
    # A migrated stream's draws made its last prompt tokens: more draws than tokens is a forged count
    # (skipping 2**31 draws would hold the engine thread for hours).
    with pytest.raises(ValueError, match="draws_made"):
        engine.add_request("a", [5, 6], dataclasses.replace(GREEDY, temperature=1.0, seed=1, draws_made=3))
    engine.add_request("a", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [5, 6], GREEDY)
    assert engine.abort_request("a")
    engine.step()


# --- the asyncio front ------------------------------------------------------------


@pytest.fixture
def async_engine(make_engine: MakeEngine) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(make_engine())
    engine.start()
    yield engine
    assert engine.shutdown(timeout=30)


async def wait_for_free_blocks(engine: AsyncEngine) -> EngineStats:
    """The pool is whole once the engine thread has processed every abort."""
    for _ in range(200):
        stats = engine.stats()
        if stats.kv_blocks_free == stats.kv_blocks_total and stats.requests_running + stats.requests_waiting == 0:
            return stats
        await asyncio.sleep(0.05)
    raise AssertionError(f"blocks were not freed: {engine.stats()}")


async def collect(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    got: list[int] = []
    async for out in engine.generate(rid, prompt, params):
        got += out.new_token_ids
    assert out.finished
    return got


async def test_async_generate_equals_the_sync_engine(async_engine: AsyncEngine, make_engine: MakeEngine) -> None:
    batch = prompts(4, [3, 11, 6, 1], seed=11)
    expected = tokens(run(make_engine(), [(p, GREEDY) for p in batch]))
    got = await asyncio.gather(*(collect(async_engine, f"r{i}", p, GREEDY) for i, p in enumerate(batch)))
    assert list(got) == expected
    await wait_for_free_blocks(async_engine)


async def test_consumer_cancellation_aborts_the_request(async_engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    stream = async_engine.generate("long", prompts(1, [5])[0], params)
    first = await anext(stream)
    assert not first.finished
    await stream.aclose()
    await wait_for_free_blocks(async_engine)

    # Cancelled once it has streamed, not after a fixed time: a fast engine
    # could finish all its tokens first.
    streaming = asyncio.Event()

    async def consume() -> None:
        async for _ in async_engine.generate("cancelled", prompts(1, [5])[0], params):
            streaming.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(streaming.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for_free_blocks(async_engine)


async def test_abort_from_outside_ends_the_stream(async_engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    outputs = []
    async for out in async_engine.generate("victim", prompts(1, [5])[0], params):
        outputs.append(out)
        if len(outputs) == 2:
            async_engine.abort("victim")
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    await wait_for_free_blocks(async_engine)


async def test_invalid_request_raises_to_the_caller(async_engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        await collect(async_engine, "bad", [], GREEDY)
    assert await collect(async_engine, "good", [5, 6, 7], GREEDY)


async def test_engine_errors_reach_the_consumers(async_engine: AsyncEngine) -> None:
    runner = async_engine.engine.model_runner
    pool = runner.kv_cache.tensor
    runner.kv_cache.tensor = torch.empty(0)  # every forward now fails
    try:
        with pytest.raises(EngineError, match="step failed"):
            await asyncio.wait_for(collect(async_engine, "doomed", [5, 6, 7], GREEDY), timeout=30)
    finally:
        runner.kv_cache.tensor = pool
    await wait_for_free_blocks(async_engine)
    # The loop survived and serves the next request.
    assert len(await collect(async_engine, "next", [5, 6, 7], GREEDY)) == GREEDY.max_tokens


async def test_call_runs_on_the_engine_thread_and_returns_or_raises(async_engine: AsyncEngine) -> None:
    # Between steps of a running request: the call sees the engine's own state.
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    stream = async_engine.generate("busy", prompts(1, [5])[0], params)
    await anext(stream)
    thread, running = await async_engine.call(lambda e: (threading.current_thread().name, e.num_running))
    assert thread == "engine-loop" and running == 1
    with pytest.raises(ValueError, match="already in use"):
        await async_engine.call(lambda e: e.add_request("busy", [5], GREEDY))
    await stream.aclose()
    await wait_for_free_blocks(async_engine)


async def test_a_call_cancelled_before_it_runs_still_runs_and_the_engine_lives_on(async_engine: AsyncEngine) -> None:
    ran = threading.Event()
    blocker = asyncio.create_task(async_engine.call(lambda e: time.sleep(0.3)))  # holds the engine thread
    await asyncio.sleep(0.05)
    cancelled = asyncio.create_task(async_engine.call(lambda e: ran.set()))
    await asyncio.sleep(0.05)
    cancelled.cancel()  # a request that ended while its call was queued (a prefill's hand-off)
    await blocker
    assert await async_engine.call(lambda e: ran.is_set()) and async_engine.is_running


class HeldGate:
    """A step gate that stays closed until opened, counting what the loop asked of it; its
    steps take at most `cap` tokens."""

    def __init__(self, cap: int, threads: list[int | None] | None = None) -> None:
        self.open = threading.Event()
        self.asked = self.steps = self.idles = 0
        self.cap = cap
        self.thread_caps = threads or [None]  # by step, the last one for every later step
        self.threads_seen: list[int] = []  # torch's threads in the engine thread, after each step

    def may_step(self, requests: int) -> bool:
        assert requests == 1  # the one request of the test below, waiting
        self.asked += 1
        return self.open.is_set()

    def step_tokens(self) -> int:
        return self.cap

    def step_threads(self) -> int | None:
        return self.thread_caps[min(self.steps, len(self.thread_caps) - 1)]

    def after_step(self) -> None:
        self.threads_seen.append(torch.get_num_threads())
        self.steps += 1

    def idle(self) -> None:
        self.idles += 1


async def test_a_closed_step_gate_holds_the_steps_but_not_the_commands(make_engine: MakeEngine) -> None:
    engine, gate = AsyncEngine(make_engine()), HeldGate(cap=4)
    engine.set_step_gate(gate)
    engine.start()
    prompt = prompts(1, [6], seed=4)[0]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = tokens(run(make_engine(), [(prompt, params)]))[0]
    try:
        task = asyncio.create_task(collect(engine, "held", prompt, params))
        # While the gate is closed the request waits, and calls still run between its asks.
        for _ in range(100):
            if await engine.call(lambda e: e.num_running + e.scheduler.num_waiting) == 1:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert await engine.call(lambda e: e.scheduler.num_waiting) == 1
        assert not task.done() and gate.steps == 0 and gate.asked > 1
        idles = gate.idles  # the loop was idle before the request came
        gate.open.set()
        assert await asyncio.wait_for(task, 60) == expected
        await wait_for_free_blocks(engine)
        for _ in range(100):  # the loop tells the gate once it has nothing to step
            if gate.idles > idles:
                break
            await asyncio.sleep(0.02)
        assert gate.idles > idles
        # Each step was followed by after_step, before the loop idled; the 6-token prompt ran in
        # two steps of at most 4 tokens, then a step per later token.
        assert gate.steps == 2 + len(expected) - 1
    finally:
        assert await asyncio.to_thread(engine.shutdown, 30)


async def test_a_step_gate_caps_a_steps_threads_and_the_next_step_gets_them_back(make_engine: MakeEngine) -> None:
    """CPU turns: a step beside another worker on one thread, then the worker's own again."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # the worker's threads, read by the engine thread when its loop begins
    try:
        engine, gate = AsyncEngine(make_engine()), HeldGate(cap=64, threads=[1, 1, None])
        engine.set_step_gate(gate)
        gate.open.set()
        engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        await asyncio.wait_for(collect(engine, "threads", prompts(1, [6], seed=5)[0], params), 60)
        # The last token reaches the stream before its step's after_step: read them once the loop ended.
        assert await asyncio.to_thread(engine.shutdown, 30)
        assert gate.threads_seen == [1, 1, 3, 3]  # a prefill step, then a step per later token
    finally:
        torch.set_num_threads(threads)


async def test_shutdown_fails_open_streams(make_engine: MakeEngine) -> None:
    engine = AsyncEngine(make_engine())
    engine.start()
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    stream = engine.generate("endless", prompts(1, [5])[0], params)
    await anext(stream)
    assert await asyncio.to_thread(engine.shutdown, 30)
    with pytest.raises(EngineError, match="shut down"):
        async for _ in stream:
            pass
    assert engine.engine.num_free_blocks == engine.engine.num_total_blocks
    with pytest.raises(EngineError):
        await anext(engine.generate("late", [5], GREEDY))


async def test_a_stream_opened_as_the_loop_stops_is_refused_not_left_waiting(
        make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop stops between a new stream's running check and its registration: nothing would
    ever end that stream, so it is refused (before, it waited forever)."""
    engine = AsyncEngine(make_engine())
    engine.start()
    checked = engine.engine.check_request

    def stop_meanwhile(prompt: list[int], params: SamplingParams) -> None:
        checked(prompt, params)
        assert engine.shutdown(30)

    monkeypatch.setattr(engine.engine, "check_request", stop_meanwhile)
    with pytest.raises(EngineError, match="not running"):
        await asyncio.wait_for(anext(engine.generate("racing", [5, 6], GREEDY)), timeout=10)


# --- CUDA ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_the_cpu_engine(make_engine: MakeEngine) -> None:
    batch = prompts(4, [3, 9, 17, 5], seed=12)
    cpu = tokens(run(make_engine(), [(p, GREEDY) for p in batch]))
    cuda_engine = make_engine(device="cuda", dtype="float32")
    assert tokens(run(cuda_engine, [(p, GREEDY) for p in batch])) == cpu
    # Seeds, penalties and logprobs on the device: a seed reproduces its tokens.
    seeded = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7, repetition_penalty=1.2,
                            logprobs=2, max_tokens=8, ignore_eos=True)
    first, second = (run(cuda_engine, [(batch[0], seeded)])[0] for _ in range(2))
    assert first.token_ids == second.token_ids and len(first.token_ids) == 8
    bf16 = run(make_engine(device="cuda", dtype="bfloat16"), [(p, GREEDY) for p in batch])
    assert all(len(r.token_ids) == GREEDY.max_tokens for r in bf16)


def test_hand_off_then_admit_elsewhere_equals_one_engine(make_engine: MakeEngine) -> None:
    """The PD split inside one process: `hold_after_first_token` on one engine,
    `reserve_request` + a KV copy + `admit_request` on another."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = prompts(1, [10], seed=3)[0]
    [expected] = tokens(run(make_engine(), [(prompt, params)]))
    prefill, decode = make_engine(), make_engine()
    prefill.add_request("r", prompt, params, hold_after_first_token=True)
    outputs = []
    while prefill.has_unfinished_requests:
        outputs += prefill.step()
    [hand_off] = outputs
    assert hand_off.finished and hand_off.handed_off and hand_off.finish_reason is None
    assert hand_off.new_token_ids == expected[:1]
    src = list(hand_off.held_block_ids)  # held: the blocks stay until released
    assert len(src) == -(-len(prompt) // prefill.config.block_size)
    prefill.check_integrity()
    dst = decode.reserve_request("r", prompt, params)
    assert len(dst) == len(src) and not decode.has_unfinished_requests
    decode.kv_cache.tensor[:, dst] = prefill.kv_cache.tensor[:, src]
    assert prefill.release_request("r") and not prefill.release_request("r")
    decode.admit_request("r", hand_off.new_token_ids[0])
    rest: list[int] = []
    while decode.has_unfinished_requests:
        for out in decode.step():
            rest += out.new_token_ids
    assert hand_off.new_token_ids + rest == expected
    assert out.finish_reason is FinishReason.LENGTH


def test_reserve_request_refuses_what_never_fits_or_does_not_fit_now(make_engine: MakeEngine) -> None:
    engine = make_engine(num_kv_blocks=4)
    with pytest.raises(PromptTooLarge):
        engine.reserve_request("big", list(range(3, 3 + 20)), GREEDY)
    engine.reserve_request("a", list(range(3, 3 + 12)), GREEDY)
    with pytest.raises(OutOfBlocks):
        engine.reserve_request("b", list(range(3, 3 + 8)), GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.reserve_request("a", [5], GREEDY)
    assert engine.abort_request("a")
    engine.step()  # delivers the abort


# --- prompt logprobs, logit_bias, min_tokens ------------------------------------------


def _reference_prompt_logprobs(tiny_model: Callable[..., Path], prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: transformers' logprobs of each next prompt token's position."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("overrides", [{}, {"max_num_batched_tokens": 5}, {"num_kv_blocks": 16}],
                         ids=["whole", "chunked", "preempted"])
def test_prompt_logprobs_equal_transformers_and_skip_the_prefix_cache(
        make_engine: MakeEngine, tiny_model: Callable[..., Path], overrides: dict[str, int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg.workers.engine import model_runner

    monkeypatch.setattr(model_runner, "_PROMPT_LOGPROB_ROWS", 5)  # a step's rows in several slices
    prompt = prompts(1, [13], seed=21)[0]
    engine = make_engine(**overrides)
    run(engine, [(prompt, GREEDY)])  # the prompt's blocks are now in the prefix cache
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)
    # Others alongside: chunks, preemption (in the small pool) and recompute must not repeat or skip a position.
    batch = [(prompt, params)] + [(p, GREEDY) for p in prompts(3, [11, 9, 14], seed=22)]
    results = run(engine, batch)
    got = [o.prompt_logprobs for o in results[0].outputs if o.prompt_logprobs is not None]
    assert len(got) == 1, "prompt logprobs come once, with the first token"
    entries = got[0]
    assert len(entries) == len(prompt) and entries[0] is None
    reference = _reference_prompt_logprobs(tiny_model, prompt)
    for position, entry in enumerate(entries[1:]):
        assert entry is not None and entry.token_id == prompt[position + 1]
        row = reference[position]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        assert entry.rank == int((row > row[entry.token_id]).sum()) + 1
        assert [t for t, _ in entry.top] == row.topk(2).indices.tolist()
    assert results[0].token_ids == tokens(run(engine, [(prompt, GREEDY)]))[0]


def test_logit_bias_moves_greedy_choices(make_engine: MakeEngine) -> None:
    engine = make_engine()
    prompt = prompts(1, [6], seed=23)[0]
    free = tokens(run(engine, [(prompt, GREEDY)]))[0]
    forced = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias=((77, 100.0),))
    assert tokens(run(engine, [(prompt, forced)]))[0] == [77] * 8
    banned = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias=((free[0], -100.0),))
    out = tokens(run(engine, [(prompt, banned)]))[0]
    assert free[0] not in out and out != free
    # A biased row does not change its unbiased neighbours in the batch.
    assert tokens(run(engine, [(prompt, forced), (prompt, GREEDY)]))[1] == free


def test_min_tokens_holds_back_eos_stop_tokens_and_stop_strings(make_engine: MakeEngine) -> None:
    engine = make_engine()
    eos = min(engine.stop_checker.eos_token_ids)
    prompt = prompts(1, [6], seed=24)[0]
    eager = SamplingParams(temperature=0.0, max_tokens=8, logit_bias=((eos, 100.0),))
    assert tokens(run(engine, [(prompt, eager)]))[0] == [eos]
    waited = run(engine, [(prompt, SamplingParams(temperature=0.0, max_tokens=8, logit_bias=((eos, 100.0),),
                                                  min_tokens=3))])[0]
    assert waited.token_ids[:3] != [eos] * 3 and eos not in waited.token_ids[:3]
    assert waited.token_ids[3] == eos and waited.final.finish_reason == "stop"
    free = run(engine, [(prompt, GREEDY)])[0]
    stop_id = free.token_ids[0]
    held = run(engine, [(prompt, dataclasses.replace(GREEDY, stop_token_ids=(stop_id,), min_tokens=4))])[0]
    assert stop_id not in held.token_ids[:4]
    stop_text = free.text[:2]
    assert stop_text, "the random model's text is too short"
    late = run(engine, [(prompt, dataclasses.replace(GREEDY, stop=(stop_text,), min_tokens=8))])[0]
    assert late.final.finish_reason == "length" and late.text.startswith(stop_text)


@pytest.mark.parametrize(("flags", "native"), [
    ("fpu sse2 avx avx2 fma", False),
    ("fpu avx2 avx512f avx512bw avx512_vnni", False),  # AVX-512 without its bf16 instructions
    ("fpu avx2 avx512f avx512_bf16", True),
    ("fpu avx2 amx_tile amx_bf16 amx_int8", True),
])
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path: Path, flags: str, native: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: some CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert cpu_has_native_bf16(cpuinfo) is native
    assert cpu_has_native_bf16(tmp_path / "absent") is False


def test_auto_dtype_follows_the_device_and_the_cpu() -> None:
    assert EngineConfig(model="m", device="cpu", dtype="float32").torch_dtype == torch.float32
    assert EngineConfig(model="m", device="cpu", dtype="bfloat16").torch_dtype == torch.bfloat16
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert EngineConfig(model="m", device="cpu").torch_dtype == expected
