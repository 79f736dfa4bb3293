"""The sender's queue merges queued writes of consecutive layers and the same runs, and nothing else."""

from __future__ import annotations

from disagg.workers.transfer.base import BlockRun
from disagg.workers.transfer.send_queue import LayerWrite, SendQueue
from disagg.workers.transfer.wire import ChecksumKind, Frame, Kind

RUNS = (BlockRun(0, 4, 2), BlockRun(7, 1, 1))


def write(request_id: int, layer: int, runs: tuple[BlockRun, ...] = RUNS, size: int = 100) -> LayerWrite:
    return LayerWrite(Frame(Kind.WRITE, ChecksumKind.XXH3, request_id, layer, 1, runs, size), None)


def test_consecutive_layers_of_the_same_runs_come_out_together_in_order() -> None:
    jobs = SendQueue()
    first, second, third = write(1, 0), write(2, 1), write(3, 2)
    for job in (first, second, third):
        jobs.put(job)
    assert jobs.get() == [first, second, third]


def test_a_job_that_does_not_continue_the_frame_ends_it_and_comes_next() -> None:
    jobs = SendQueue()
    control = lambda: None  # noqa: E731  (stands for an ACK or a READ)
    queued = [write(1, 0), write(2, 1), control, write(3, 2), write(4, 0, (BlockRun(9, 9, 1),)),
              write(5, 2, (BlockRun(9, 9, 1),)), None]
    for job in queued:
        jobs.put(job)
    out = [jobs.get() for _ in range(6)]
    assert out == [[queued[0], queued[1]], control, [queued[3]], [queued[4]], [queued[5]], None]


def test_a_frame_stops_growing_at_its_byte_limit() -> None:
    jobs = SendQueue(max_frame_bytes=250)
    queued = [write(i, i) for i in range(5)]
    for job in queued:
        jobs.put(job)
    assert [jobs.get(), jobs.get(), jobs.get()] == [queued[0:2], queued[2:4], queued[4:5]]
