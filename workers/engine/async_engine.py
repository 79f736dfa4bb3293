"""The engine loop in one background thread, with an asyncio front.

Only the engine thread touches the LLMEngine after `start`: other threads
hand it commands through a queue and receive outputs through each request's
asyncio queue, so a long step never blocks the event loop (HTTP keeps
serving while a long prompt runs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from disagg.workers.engine.llm_engine import LayerHook, LLMEngine
from disagg.workers.engine.outputs import FinishReason, RequestOutput, TokenLogprob
from disagg.workers.engine.request import Request
from disagg.workers.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
E = TypeVar("E", bound=LLMEngine)

# How long the idle loop sleeps between looks at its command queue when
# nobody wakes it (a safety net: every command also wakes it).
_IDLE_WAIT_S = 0.5
_CALL_TIMEOUT_S = 120.0  # an engine step on a CPU can be long, never this long
_GATE_POLL_S = 0.001  # between asks of a closed step gate (commands still wake the loop at once)


class EngineError(RuntimeError):
    """The engine failed a request it had accepted (a step raised, or it shut down)."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load, for routing, draining and the metrics
    gauges (the first four fields are named after the gauges they set)."""

    kv_blocks_total: int
    kv_blocks_free: int
    requests_running: int
    requests_waiting: int
    num_preemptions: int


StreamItem = RequestOutput | BaseException  # what a request's stream receives: an output, or the error that ends it


async def outputs_until_finished(outputs: asyncio.Queue[StreamItem]) -> AsyncIterator[RequestOutput]:
    """The outputs put into one request's queue, up to the finished one; an
    exception put into it is raised instead."""
    while True:
        item = await outputs.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finished:
            return


@dataclass
class _Stream:
    """Where one request's outputs go: a queue owned by the consumer's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StreamItem]


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hold_after_first_token: bool = False


@dataclass(frozen=True)
class _Admit:
    request_id: str
    token_id: int  # the first token, sampled where the prompt ran


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[Any], object]
    future: concurrent.futures.Future[object]


_Command = _Add | _Admit | _Abort | _Call


class StepGate(Protocol):
    """Whether the engine may step now (workers/pd/cpu_turns.py: co-located roles take turns)."""

    def may_step(self, requests: int) -> bool:
        """Asked before each step, between looks at the command queue, with the requests the
        step would serve (running and waiting); must not block."""
        ...

    def step_tokens(self) -> int | None:
        """A cap on the next step's tokens, asked when `may_step` said yes; None: the engine's budget."""
        ...

    def step_threads(self) -> int | None:
        """A cap on the next step's threads, asked when `may_step` said yes; None: every thread the
        worker was given."""
        ...

    def after_step(self) -> None: ...

    def idle(self) -> None:
        """The engine has nothing to step."""
        ...


class _OpenGate:
    def may_step(self, requests: int) -> bool:
        return True

    def step_tokens(self) -> int | None:
        return None

    def step_threads(self) -> int | None:
        return None

    def after_step(self) -> None:
        pass

    def idle(self) -> None:
        pass


class AsyncEngine(Generic[E]):
    def __init__(self, engine: E) -> None:
        self.engine = engine
        self._gate: StepGate = _OpenGate()
        self._threads = torch.get_num_threads()  # the worker's compute threads, set before the engine
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and _failed
        self._failed = False  # every open stream was failed: no new one may open (nothing would end it)
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # --- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop the loop after its current step; fail every open stream.
        Returns False when the loop did not stop within `timeout` seconds."""
        self._stopping.set()
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        stopped = not self._thread.is_alive()
        if stopped:
            # The engine thread is gone, so this thread may touch the engine now.
            for request_id in list(self.engine.scheduler.requests):
                self.engine.abort_request(request_id)
            self.engine.step()  # takes the abort reports; runs nothing, since nothing is left
        self._fail_all(EngineError("the engine shut down"))
        return stopped

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    # --- requests -----------------------------------------------------------

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 hold_after_first_token: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs until the finished one.

        With `hold_after_first_token` the stream ends after the first token
        (`handed_off`), and the request's blocks stay held until `release`.
        Raises ValueError (on the first iteration) for a request the engine can
        never run, EngineError when the engine fails or stops. Closing or
        cancelling the iteration aborts the request and frees its blocks.
        """
        return self._stream(request_id, _Add(request_id, list(prompt_token_ids), params, hold_after_first_token))

    def admit(self, request_id: str, token_id: int) -> AsyncIterator[RequestOutput]:
        """Decode a reserved request (see `LLMEngine.admit_request`) after its first
        token; stream its later outputs, as `generate` does."""
        return self._stream(request_id, _Admit(request_id, token_id))

    async def _stream(self, request_id: str, command: _Add | _Admit) -> AsyncIterator[RequestOutput]:
        if not self.is_running:
            raise EngineError(f"the engine is not running: {self._dead or 'stopped'}")
        if isinstance(command, _Add):
            self.engine.check_request(command.prompt_token_ids, command.params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self._failed:  # the loop stopped since the check above
                raise EngineError(f"the engine is not running: {self._dead or 'stopped'}")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._submit(command)
        finished = False
        try:
            async for item in outputs_until_finished(stream.queue):
                finished = item.finished
                yield item
        except (EngineError, ValueError):
            finished = True  # the engine delivered the error: it already dropped the request
            raise
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._submit(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        """Cancel a request from any thread; its stream ends with an "abort" output."""
        self._submit(_Abort(request_id))

    async def call(self, fn: Callable[[E], T]) -> T:
        """Run `fn(engine)` on the engine thread between two steps; its result or its exception."""
        if not self.is_running:
            raise EngineError("the engine is not running")
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._submit(_Call(fn, future))
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(future), _CALL_TIMEOUT_S)
        except TimeoutError as exc:
            raise EngineError(f"the engine did not run a call within {_CALL_TIMEOUT_S:.0f} s") from exc
        return result  # type: ignore[return-value]

    async def release(self, request_id: str) -> bool:
        """Free the blocks of a held request; False when none holds them."""
        return await self.call(lambda e: e.release_request(request_id))

    def set_layer_hook(self, hook: LayerHook) -> None:
        """Install the per-step layer hook; before `start`, as the engine thread reads it."""
        assert not self._thread.is_alive(), "the layer hook is set before the engine starts"
        self.engine.layer_hook = hook

    def set_step_gate(self, gate: StepGate) -> None:
        """Install what the loop asks before each step; before `start`, as the engine thread reads it."""
        assert not self._thread.is_alive(), "the step gate is set before the engine starts"
        self._gate = gate

    # --- fixed settings: safe from any thread ------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError when the request can never run."""
        self.engine.check_request(prompt_token_ids, params)

    def new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """A request this engine never runs (`follow` feeds it tokens made elsewhere)."""
        return self.engine.new_request(request_id, prompt_token_ids, params)

    def follow(self, request: Request, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None,
               finish_reason: FinishReason | None = None) -> RequestOutput:
        """See `LLMEngine.follow`: safe on any thread, for a request from `new_request`."""
        return self.engine.follow(request, token_ids, logprobs, finish_reason)

    def abort_followed(self, request: Request) -> RequestOutput:
        """See `LLMEngine.abort_followed`: safe on any thread."""
        return self.engine.abort_followed(request)

    @property
    def kv_pool(self) -> torch.Tensor:
        """The KV pool tensor, which transports read and write in place (layout: kv_cache.py)."""
        return self.engine.kv_cache.tensor

    @property
    def block_size(self) -> int:
        """Tokens per KV block (a fixed setting)."""
        return self.engine.config.block_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across all layers (what a transfer moves per block)."""
        return self.engine.kv_cache.spec.block_bytes

    def stats(self) -> EngineStats:
        engine = self.engine
        return EngineStats(
            kv_blocks_total=engine.num_total_blocks,
            kv_blocks_free=engine.num_free_blocks,
            requests_running=engine.num_running,
            requests_waiting=engine.num_waiting,
            num_preemptions=engine.scheduler.num_preemptions,
        )

    def _submit(self, command: _Command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # --- the engine thread ----------------------------------------------------

    def _run(self) -> None:
        idle_checked = False
        try:
            while not self._stopping.is_set():
                self._wakeup.clear()
                self._apply_commands()
                if not self.engine.has_unfinished_requests:
                    if not idle_checked:
                        self._gate.idle()
                        self.engine.check_integrity()
                        idle_checked = True
                    self._wakeup.wait(_IDLE_WAIT_S)
                    continue
                idle_checked = False
                if not self._gate.may_step(self.engine.num_running + self.engine.num_waiting):
                    self._wakeup.wait(_GATE_POLL_S)
                    continue
                try:
                    self._step()
                finally:
                    self._gate.after_step()
        except Exception as exc:  # the loop itself broke: nobody may wait on it
            logger.exception("engine loop died")
            self._dead = exc
            self._stopping.set()
            self._fail_all(EngineError(f"the engine loop died: {exc}"))

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
                continue
            if isinstance(command, _Call):
                # NOTE: a caller cancelled meanwhile (its request ended) still gets its call run, for
                # the engine state it asked for, but no result: setting one would raise here.
                wanted = command.future.set_running_or_notify_cancel()
                try:
                    result = command.fn(self.engine)
                except Exception as exc:  # handed to the caller's event loop
                    if wanted:
                        command.future.set_exception(exc)
                    continue
                if wanted:
                    command.future.set_result(result)
                continue
            try:
                if isinstance(command, _Admit):
                    self.engine.admit_request(command.request_id, command.token_id)
                else:
                    self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                            command.hold_after_first_token)
            except ValueError as exc:
                self._deliver(command.request_id, exc)

    def _use_threads(self, cap: int | None) -> None:
        """The next step's threads: the worker's own, or fewer while the gate says so. torch's
        count is the engine thread's own (OpenMP's per-thread setting); the kernels read it at
        each call."""
        wanted = self._threads if cap is None else max(1, min(cap, self._threads))
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)

    def _step(self) -> None:
        self._use_threads(self._gate.step_threads())
        try:
            outputs = self.engine.step(self._gate.step_tokens())
        except Exception as exc:
            # A failed step leaves its requests in an unknown state: fail and
            # drop them all (freeing their blocks), and keep serving new ones.
            logger.exception("engine step failed")
            failed = list(self.engine.scheduler.requests)
            for request_id in failed:
                self.engine.abort_request(request_id)
            self.engine.step()  # reports the aborts; runs nothing, since nothing is left
            error = EngineError(f"engine step failed: {exc}")
            self._deliver_all([(request_id, error) for request_id in failed])
            return
        self._deliver_all([(output.request_id, output) for output in outputs])

    def _deliver(self, request_id: str, item: StreamItem) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: Sequence[tuple[str, StreamItem]]) -> None:
        """Hand each item to its request's queue: one wake-up of each consumer loop per call, not
        one per request (a step of 32 sequences would otherwise wake the event loop 32 times,
        each wake-up taking the GIL from the next step)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[StreamItem], StreamItem]]] = {}
        with self._lock:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is not None:  # else the consumer left; its abort is on the way
                    by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:
                logger.debug("an event loop of %d request(s) is closed", len(puts))

    def _fail_all(self, error: EngineError) -> None:
        with self._lock:
            self._failed = True
            request_ids = list(self._streams)
        self._deliver_all([(request_id, error) for request_id in request_ids])


def _put_all(puts: Sequence[tuple[asyncio.Queue[StreamItem], StreamItem]]) -> None:
    for q, item in puts:
        q.put_nowait(item)
