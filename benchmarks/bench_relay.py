"""What one Generations call costs, the decode-to-prefill relay of PD (a script, not a test).

A decode streams each engine step's tokens to their prefill in one
`XllmRpcService.Generations` call (`PeerClients.generations`, coalesced per
prefill). Here a prefill-role gRPC server (`build_grpc_server`, with its
cluster-key check and strict decoding, answering every output as tracked) runs
in a child process, and this process makes `--calls` calls one after the other
through the decode's own client. Printed per call, for each number of outputs
per call: wall time, and the CPU time of the calling process and of the
serving one (user + system, from /proc, every thread included: the event loop
and gRPC's own threads). The relay's per-token work on either side (the
engine's outputs to their streams, the client's SSE) is not in it.

    .venv/bin/python benchmarks/bench_relay.py [--calls 2000] [--outputs 1 8 32]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import tempfile
import time
from multiprocessing.synchronize import Event
from pathlib import Path

from disagg.proto.vocabulary import InstanceInfo
from disagg.testing.processes import cpu_seconds
from disagg.workers.engine.outputs import RequestOutput
from disagg.workers.local import free_port
from disagg.workers.pd.clients import PeerClients
from disagg.workers.pd.config import PDConfig
from disagg.workers.pd.service import Handlers, build_grpc_server
from disagg.workers.security.control import ControlGuard
from disagg.workers.security.key import ClusterKey

WARM_UP_CALLS = 100
STARTUP_S = 30.0


def serve(address: str, key_file: str, up: Event, stop: Event) -> None:
    """A prefill's gRPC server that tracks every request it is told of."""

    async def tracked(outputs: list[RequestOutput]) -> list[bool]:
        return [True] * len(outputs)

    async def unlink(name: str) -> None:
        return None

    async def main() -> None:
        handlers = Handlers("prefill", unlink=unlink, generations=tracked)
        server = build_grpc_server(handlers, address, PDConfig().max_message_bytes,
                                   ControlGuard(ClusterKey.from_file(key_file)), InstanceInfo(address, "127.0.0.1:1"))
        await server.start()
        up.set()
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await server.stop(None)

    asyncio.run(main())


def step_outputs(step: int, rows: int) -> list[RequestOutput]:
    """One engine step's outputs of `rows` requests: a token each, as a decode sends them."""
    return [RequestOutput(request_id=f"req-{row}", new_token_ids=[1000 + step % 30000], new_text="", finished=False,
                          finish_reason=None, num_prompt_tokens=256, num_output_tokens=step + 1)
            for row in range(rows)]


async def timed_calls(clients: PeerClients, address: str, server_pid: int, rows: int,
                      calls: int) -> tuple[float, float, float]:
    """(wall, own CPU, server CPU) seconds per call."""
    for step in range(WARM_UP_CALLS):
        await clients.generations(address, step_outputs(step, rows))
    own, served, began = cpu_seconds(os.getpid()), cpu_seconds(server_pid), time.perf_counter()
    for step in range(calls):
        tracked = await clients.generations(address, step_outputs(step, rows))
        if tracked != [True] * rows:
            raise RuntimeError(f"the server answered {tracked}")
    wall = time.perf_counter() - began
    return wall / calls, (cpu_seconds(os.getpid()) - own) / calls, (cpu_seconds(server_pid) - served) / calls


async def measure(address: str, key_file: Path, server_pid: int, outputs: list[int], calls: int) -> None:
    clients = PeerClients(PDConfig(), ClusterKey.from_file(key_file))
    try:
        for rows in outputs:
            wall, own, served = await timed_calls(clients, address, server_pid, rows, calls)
            print(f"{rows:3} outputs per call: {wall * 1e6:6.0f} us wall, CPU {own * 1e6:5.0f} us calling + "
                  f"{served * 1e6:5.0f} us serving = {(own + served) / rows * 1e6:5.0f} us per output", flush=True)
    finally:
        await clients.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000, help="timed calls per size (default %(default)s)")
    p.add_argument("--outputs", type=int, nargs="+", default=[1, 8, 32], help="outputs per call")
    args = p.parse_args()
    address = f"127.0.0.1:{free_port()}"
    spawn = multiprocessing.get_context("spawn")
    up, stop = spawn.Event(), spawn.Event()
    with tempfile.TemporaryDirectory(prefix="bench-relay-") as folder:
        key_file = Path(folder) / "cluster.key"
        ClusterKey.generate().write(key_file)
        server = spawn.Process(target=serve, args=(address, str(key_file), up, stop), daemon=True)
        server.start()
        try:
            if not up.wait(STARTUP_S):
                raise RuntimeError(f"the gRPC server did not start within {STARTUP_S:.0f} s")
            print(f"{args.calls} Generations calls per size to {address}, one after the other "
                  f"(load average {os.getloadavg()[0]:.2f})", flush=True)
            assert server.pid is not None
            asyncio.run(measure(address, key_file, server.pid, args.outputs, args.calls))
        finally:
            stop.set()
            server.join(10.0)
            if server.is_alive():
                server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
