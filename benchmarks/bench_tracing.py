"""What traces cost a PD request (a script, not a test; docs/tracing.md).

1. Tracing off: the time of each helper the request path calls (one check of
   whether a tracer exists), and those times summed over the calls one request
   makes on each role.
2. A prefill and a decode in this process (the tests' tiny random Llama, real
   gRPC and tcp on loopback): requests one after another, each through the
   PD flow, with tracing off and on (every span exported to memory); the
   median time per request of each, in alternating rounds.

Run it on a commit from before traces with `--modes off` for the "before"
figure (the script imports workers/tracing.py only for the rest).

    .venv/bin/python benchmarks/bench_tracing.py [--requests 40] [--rounds 5] [--max-tokens 16] [--modes off on]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

import torch

from disagg.proto import disagg_pd_pb2_grpc
from disagg.proto.vocabulary import InstanceInfo
from disagg.testing.tiny_model import build_tiny_model
from disagg.workers.config import Role, ServerConfig, TransferMode
from disagg.workers.engine.config import EngineConfig
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.local import free_port
from disagg.workers.metrics import WorkerMetrics
from disagg.workers.pd.worker import PDWorker, build_decode, build_prefill
from disagg.workers.security.control import control_channel
from disagg.workers.security.key import ClusterKey

KEY = ClusterKey.generate()


def helper_costs() -> None:
    """Nanoseconds per call of each helper with tracing off; per request, as the roles call them."""
    from disagg.workers import tracing

    assert not tracing.configure("bench", environ={}), "tracing must be off for this part"
    n = 200_000

    def ns(stmt: Any) -> float:
        return min(timeit.repeat(stmt, number=n, repeat=5)) / n * 1e9

    def span() -> None:
        with tracing.span("x"):
            pass

    def client_call() -> None:
        with tracing.client_call("s", "m", "p"):
            pass

    costs = {"is_enabled": ns(tracing.is_enabled), "span": ns(span), "client_call": ns(client_call),
             "start/end": ns(lambda: tracing.end(tracing.start("x"))), "record": ns(lambda: tracing.record("x", 0, 1)),
             "current": ns(tracing.current), "annotate": ns(lambda: tracing.annotate({}))}
    for name, value in costs.items():
        print(f"  tracing off, {name:12s} {value:7.0f} ns per call")
    # The calls one handed-off request makes (workers/pd/prefill.py, clients.py, decode.py, service.py).
    prefill = (costs["span"] + costs["annotate"] + 2 * costs["client_call"] + 3 * costs["is_enabled"]
               + costs["start/end"] + costs["record"])
    decode = 2 * costs["span"] + costs["annotate"] + costs["current"] + costs["record"] + costs["start/end"]
    per_token = costs["span"] + costs["is_enabled"]  # each Generations call on the decode
    print(f"  tracing off, per request: prefill {prefill / 1000:.2f} us, decode {decode / 1000:.2f} us, "
          f"plus {per_token:.0f} ns per Generations call")


async def start(model: Path, role: Role) -> tuple[PDWorker, ServerConfig]:
    config = ServerConfig(role=role, host="127.0.0.1", http_port=free_port(), grpc_port=free_port(),
                          transfer_port=free_port(), kv_transfer_mode=TransferMode.PUSH, cluster_key=KEY)
    engine = EngineConfig(model=str(model), device="cpu", block_size=16, num_kv_blocks=256, max_model_len=512)
    worker = (build_prefill if role is Role.PREFILL else build_decode)(engine, config, WorkerMetrics(role.value))
    await worker.start()
    return worker, config


async def requests_per_mode(model: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    prefill, pc = await start(model, Role.PREFILL)
    decode, dc = await start(model, Role.DECODE)
    channel = control_channel(dc.instance_name, KEY)
    try:
        info = InstanceInfo(pc.instance_name, f"127.0.0.1:{pc.transfer_port}")
        assert (await disagg_pd_pb2_grpc.DisaggPDServiceStub(channel).LinkInstance(info.to_proto(), timeout=10)).ok
        deadline = time.monotonic() + 10
        while not prefill.role.ready()[0]:
            assert time.monotonic() < deadline, "the prefill never learnt its decode"
            await asyncio.sleep(0.05)
        backend = prefill.backend
        assert backend is not None, "a prefill takes client requests"
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        prompt = [(7 * i) % 300 + 3 for i in range(args.prompt_tokens)]
        seen: dict[str, list[float]] = {mode: [] for mode in args.modes}
        for r in range(args.rounds + 1):  # round 0 warms up
            for mode in args.modes if r % 2 else reversed(args.modes):
                switch(mode)
                began = time.perf_counter()
                for i in range(args.requests):
                    async for _ in backend.generate(f"{mode}-{r}-{i}", prompt, params):
                        pass
                if r:
                    seen[mode].append((time.perf_counter() - began) / args.requests)
        switch("off")
        return seen
    finally:
        await channel.close()
        for worker in (prefill, decode):
            await worker.stop()
            worker.role.close()


def switch(mode: str) -> None:
    if mode == "off" and "disagg.workers.tracing" not in sys.modules:
        return  # a checkout from before traces
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from disagg.workers import tracing

    tracing.shutdown()
    if mode == "on":
        tracing.configure("bench", exporter=InMemorySpanExporter())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="requests per round and mode")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--modes", nargs="+", choices=["off", "on"], default=["off", "on"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    # A request's last spans (the decode's) may end after its mode's provider was shut down: said once each.
    logging.getLogger("opentelemetry.sdk.trace").setLevel(logging.ERROR)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    if "on" in args.modes:
        helper_costs()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model("llama", Path(tmp))
        seen = asyncio.run(requests_per_mode(model, args))
    for mode, values in seen.items():
        print(f"  PD request ({args.prompt_tokens} prompt tokens, {args.max_tokens} out), tracing {mode}: "
              f"median {statistics.median(values) * 1000:.2f} ms per request over {len(values)} rounds "
              f"(min {min(values) * 1000:.2f}, max {max(values) * 1000:.2f})")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
