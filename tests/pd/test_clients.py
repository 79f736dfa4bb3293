"""The decode's relay to a prefill: outputs of many requests share one Generations call."""

from __future__ import annotations

import asyncio

import pytest

from disagg.workers.engine.outputs import RequestOutput
from disagg.workers.pd.clients import _Coalescer
from disagg.workers.pd.errors import PeerUnavailable


def _out(req_id: str) -> RequestOutput:
    return RequestOutput(req_id, [7], "x", False, None, 3, 1)


class _Prefill:
    """Records each call; answers `tracked` for every request but "gone"; the first call waits for `release`."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.release = asyncio.Event()
        self.fail = fail

    async def send(self, outputs: list[RequestOutput]) -> list[bool]:
        self.calls.append([o.request_id for o in outputs])
        if len(self.calls) == 1:
            await asyncio.wait_for(self.release.wait(), 5.0)
        if self.fail:
            raise PeerUnavailable("prefill down")
        return [o.request_id != "gone" for o in outputs]


def test_outputs_queued_during_a_call_go_out_in_the_next_one() -> None:
    async def run() -> None:
        prefill = _Prefill()
        relay = _Coalescer(prefill.send)
        first = asyncio.create_task(relay.submit([_out("a")]))
        await asyncio.sleep(0.01)  # "a" is in flight
        rest = [asyncio.create_task(relay.submit([_out(r)])) for r in ("b", "gone", "c")]
        cancelled = asyncio.create_task(relay.submit([_out("late")]))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        prefill.release.set()
        assert await asyncio.wait_for(first, 5.0) == [True]
        assert await asyncio.wait_for(asyncio.gather(*rest), 5.0) == [[True], [False], [True]]
        assert prefill.calls == [["a"], ["b", "gone", "c"]]  # one call for three requests; none for the cancelled

    asyncio.run(run())


def test_a_failed_call_fails_each_of_its_callers() -> None:
    async def run() -> None:
        prefill = _Prefill(fail=True)
        relay = _Coalescer(prefill.send)
        calls = [asyncio.create_task(relay.submit([_out(r)])) for r in ("a", "b")]
        prefill.release.set()
        for call in calls:
            with pytest.raises(PeerUnavailable, match="prefill down"):
                await asyncio.wait_for(call, 5.0)
        assert prefill.calls == [["a", "b"]]

    asyncio.run(run())
