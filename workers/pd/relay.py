"""The prefill's side of each client stream: tokens from the decode (Generations)
become the client's text here.

Each `Stream` follows its request with the engine's own request state and stop
checker (`AsyncEngine.follow`), fed token by token, so text, stop strings and
finish reasons are exactly the mixed role's; the decode only sends token ids.

A stream whose decode fails (it went away, was unlinked, hung, aborted the
request, or went silent) is not failed here but handed to `on_failure`, which
the prefill sets to move it to another decode (migration) or fail it. A
moved stream gets a new wire id (`rebind`), so tokens the old decode may still
send for the old id are refused rather than mixed in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from disagg.workers.engine.async_engine import AsyncEngine, StreamItem, outputs_until_finished
from disagg.workers.engine.outputs import FinishReason, RequestOutput, TokenLogprob
from disagg.workers.engine.request import Request
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.pd.errors import DecodeFailed


@dataclass
class Stream:
    """One client request's outputs, in order, and the decode that generates them."""

    request: Request  # followed: the engine never runs it
    client_id: str  # the client's request id
    wire_id: str  # the id its current decode knows it by (a new one after each migration)
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)
    decode: str | None = None
    closed: bool = False  # the client side is done: later Generations are refused
    handed_off: bool = False  # its first token went out: the decode generates the rest
    last_output: float = field(default_factory=time.monotonic)

    def put(self, item: StreamItem) -> None:
        if not self.closed:
            self.last_output = time.monotonic()
            self.queue.put_nowait(item)

    def outputs(self) -> AsyncIterator[RequestOutput]:
        return outputs_until_finished(self.queue)


SERVED_LOCALLY = "prefill"  # `usage.served_by` of a request a prefill served itself (decision.py)
SERVED_BY_PAIR = "prefill+decode"  # ... of one handed off


# (stream, kind, message): kind is a metric label ("lost", "hung", "aborted", "idle").
FailureHook = Callable[[Stream, str, str], None]


def fail_stream(stream: Stream, kind: str, message: str) -> None:
    """The default `on_failure`: the client gets the error."""
    stream.put(DecodeFailed(message))


class TokenRelay:
    def __init__(self, engine: AsyncEngine, vocab_size: int) -> None:
        self._engine = engine
        self._vocab_size = vocab_size
        self._streams: dict[str, Stream] = {}  # by client id
        self._by_wire: dict[str, Stream] = {}
        self.on_failure: FailureHook = fail_stream

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Stream:
        """Start relaying a new request; ValueError for a duplicate id or a request the engine refuses."""
        if request_id in self._streams or request_id in self._by_wire:
            raise ValueError(f"request id {request_id!r} is already in use")
        # The follower reads text and stops only: the grammar constrains whichever engine samples, so a
        # matcher here would be compiled and advanced for nothing, on the event loop's thread.
        followed = self._engine.new_request(request_id, prompt_token_ids, dataclasses.replace(params, grammar=None))
        stream = Stream(followed, request_id, request_id)
        self._streams[request_id] = stream
        self._by_wire[request_id] = stream
        return stream

    def rebind(self, stream: Stream, wire_id: str) -> None:
        """The stream's next decode knows it as `wire_id`; the old id is refused from now on."""
        self._by_wire.pop(stream.wire_id, None)
        stream.wire_id, stream.decode, stream.handed_off = wire_id, None, False
        self._by_wire[wire_id] = stream

    def close(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.closed = True
            self._by_wire.pop(stream.wire_id, None)

    def first_token(self, stream: Stream, hand_off: RequestOutput) -> None:
        """The token the prefill sampled, to the client, with what only the prefill's
        forward knows: the prompt's cached part and its logprobs."""
        if not stream.request.num_output_tokens:  # a moved stream's continuation caches more than the client's prompt
            stream.request.num_cached_tokens = hand_off.num_cached_tokens
        self._forward(stream, hand_off, None, hand_off.prompt_logprobs)
        stream.handed_off = True

    def forward_own(self, stream: Stream, out: RequestOutput) -> bool:
        """The prefill's own tokens for a stream no decode could continue; False once it ended."""
        return not self._forward(stream, out, out.finish_reason if out.finished else None).finished

    async def generations(self, outputs: list[RequestOutput]) -> list[bool]:
        """A decode's deltas to their clients; False for requests no longer relayed."""
        return [self._relay(out) for out in outputs]

    def abort(self, request_id: str) -> None:
        """End a live request's stream with an "abort" output."""
        stream = self._streams.get(request_id)
        if stream is not None and not stream.closed:
            stream.put(self._engine.abort_followed(stream.request))

    def fail_decode(self, decode: str, kind: str, reason: str) -> None:
        """A decode went away or hung: the requests it was generating fail over (`on_failure`)."""
        for stream in [s for s in self._streams.values() if s.decode == decode and not s.closed]:
            self.on_failure(stream, kind, f"the decode instance {decode} went away ({reason})")

    def fail_idle(self, timeout_s: float) -> None:
        """Fail handed-off streams that got nothing from their decode for `timeout_s`."""
        now = time.monotonic()
        for stream in list(self._streams.values()):
            if stream.handed_off and not stream.closed and now - stream.last_output > timeout_s:
                self.on_failure(stream, "idle", f"the decode instance {stream.decode} sent no token for "
                                                f"{timeout_s:.0f} s")

    def _relay(self, out: RequestOutput) -> bool:
        stream = self._by_wire.get(out.request_id)
        if stream is None or stream.closed or stream.request.is_finished:
            return False
        if out.finished and out.finish_reason is FinishReason.ABORT:
            self.on_failure(stream, "aborted", f"the decode instance {stream.decode} aborted request {out.request_id}")
            return False
        bad = [t for t in out.new_token_ids if not 0 <= t < self._vocab_size]
        if bad:  # a broken decode: its stream fails over as an aborted one would, the client never sees them
            self.on_failure(stream, "aborted", f"the decode instance {stream.decode} sent token ids {bad[:5]} outside "
                                               f"the vocabulary [0, {self._vocab_size})")
            return False
        delta = self._forward(stream, out, out.finish_reason if out.finished else None)
        return not delta.finished

    def _forward(self, stream: Stream, out: RequestOutput, finish: FinishReason | None,
                 prompt_logprobs: list[TokenLogprob | None] | None = None) -> RequestOutput:
        delta = dataclasses.replace(self._engine.follow(stream.request, out.new_token_ids, out.new_logprobs, finish),
                                    served_by=SERVED_BY_PAIR, prompt_logprobs=prompt_logprobs)
        stream.put(delta)
        return delta
