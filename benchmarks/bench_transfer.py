"""KV transfer throughput of the `tcp` transport between two processes (a script, not a test).

For several block sizes and layer counts it moves the same random blocks of
every layer (PUSH: layer by layer, then a flush) and compares with

- single-thread memcpy of the same runs in one process (goal: >= 1/2 of it),
- Mooncake Transfer Engine's TCP transport on the same blocks (goal: >= 2x),
  from PyPI `mooncake-transfer-engine-non-cuda` (its import needs Debian's
  `libibverbs1` even for TCP); when it cannot run, the reason is printed,
- plain sockets between the same two processes moving the same byte count from
  one contiguous buffer (sendall / recv_into, no framing, no checksum), over 1
  and over 2 connections: the faster of the two is the ceiling of any transport
  over the kernel's TCP on this machine (goal: ours >= 0.9x of it).

With `--multiturn` it then runs `bench_multiturn.py` (a real PD pair, decode-side
prefix reuse off, then on) and prints the KV bytes moved per conversation turn.

Besides GB/s it prints the CPU seconds each candidate spent per GB moved, all
its processes together and then per side (the sender is this process, the
receivers are its children; on loopback the sender's system calls also run
the receiving TCP stack): on a shared machine the wall-clock figures follow
the load, these much less.

    .venv/bin/python benchmarks/bench_transfer.py [--repeats 5] [--quick]
        [--block-sizes 16,64] [--layers 8,24] [--variants 1:AUTO,1:XXH3,2:AUTO,2:XXH3,4:XXH3,2:CRC32]
        [--multiturn]

A variant is CONNECTIONS:CHECKSUM; AUTO is the default policy (no checksum on a
loopback link like this one), XXH3 / CRC32 / NONE force one.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from disagg.testing.processes import cpu_seconds
from disagg.workers.heap import freeze_startup_heap
from disagg.workers.transfer import KVLayout, KVTransport, TransferSession, create_transport
from disagg.workers.transfer.base import BlockRun, merge_runs
from disagg.workers.transfer.pool_io import host_view
from disagg.workers.transfer.wire import ChecksumKind

BASE = KVLayout("bench", "float16", num_layers=8, num_blocks=64, block_size=16, num_kv_heads=8, head_dim=128)
BLOCKS_PER_REQUEST = 48
WAIT_S = 120.0
AUTO = "AUTO"  # a variant's checksum left to the default policy (on loopback: none)
RAW_CONNECTIONS = (1, 2)  # plain-socket candidates: the best is the ceiling


# ---- child processes (the receiving side) ------------------------------------


def child_decode(layout: KVLayout) -> None:
    """Our decode: each "link ADDRESS CONNS CHECKSUM NAME" opens one more session."""
    pool = torch.zeros(layout.shape, dtype=layout.torch_dtype)
    transports: list[KVTransport] = []
    print("ready", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command != "link":
            break
        address, conns, checksum, name = args
        transports.append(create_transport("tcp", pool, layout, name, name, num_connections=int(conns),
                                           checksums=None if checksum == AUTO else [ChecksumKind[checksum]]))
        transports[-1].connect(address, timeout=WAIT_S)
        freeze_startup_heap()  # as a serving worker does
        print("linked", flush=True)
    for transport in transports:
        transport.close()


def child_sink(layout: KVLayout) -> None:
    """The plain-socket receiver: "connect ADDRESS CONNS BYTES" opens CONNS sockets; then, per round,
    each one reads BYTES into its own buffer and answers one byte. Exits on stdin EOF."""
    print("ready", flush=True)
    command, address, conns, nbytes = sys.stdin.readline().split()
    assert command == "connect", f"unexpected command {command!r}"
    host, port = address.rsplit(":", 1)
    socks = [socket.create_connection((host, int(port)), timeout=WAIT_S) for _ in range(int(conns))]

    def serve(sock: socket.socket) -> None:
        buffer = memoryview(bytearray(int(nbytes)))
        while True:
            got = 0
            while got < len(buffer):
                n = sock.recv_into(buffer[got:], len(buffer) - got, socket.MSG_WAITALL)
                if n == 0:
                    return
                got += n
            sock.sendall(b"k")

    for sock in socks:
        threading.Thread(target=serve, args=(sock,), daemon=True).start()
    print("connected", flush=True)
    sys.stdin.read()


def child_mooncake(layout: KVLayout) -> None:
    """Mooncake's target: registers a pool and prints its address; exits on stdin EOF."""
    from mooncake.engine import TransferEngine

    pool = torch.zeros(layout.shape, dtype=layout.torch_dtype)
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake TransferEngine.initialize failed")
    if engine.register_memory(pool.data_ptr(), layout.pool_bytes) != 0:
        raise RuntimeError("mooncake register_memory failed")
    print("ready", engine.get_rpc_port(), pool.data_ptr(), flush=True)
    sys.stdin.read()


class Child:
    def __init__(self, role: str, layout: KVLayout) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", role, "--layout", json.dumps(layout.to_dict())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.first = self.line()

    def line(self) -> str:
        assert self.proc.stdout is not None, "stdout is piped"
        line = self.proc.stdout.readline().strip()
        if not line:
            assert self.proc.stderr is not None, "stderr is piped"
            tail = self.proc.stderr.read()[-600:]
            raise RuntimeError(f"child exited ({self.proc.wait(10)}): {tail}")
        return line

    def send(self, line: str) -> str:
        assert self.proc.stdin is not None, "stdin is piped"
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.line()

    def cpu_seconds(self) -> float:
        """User + system CPU time of the child so far."""
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        assert self.proc.stdin is not None, "stdin is piped"
        self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# ---- measurements ---------------------------------------------------------------


def interleaved(runs: dict[str, Callable[[], None]], repeats: int,
                cpu_clocks: Callable[[], tuple[float, float]]) -> dict[str, tuple[float, float, float]]:
    """(median seconds, mean sender CPU s, mean receiver CPU s) of each run, in rounds so load hits all alike.

    Args:
        cpu_clocks: CPU seconds used so far by (this process: the sender, the child processes: the receivers).
    """
    samples: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [0.0, 0.0] for name in runs}
    for round_ in range(repeats + 1):  # round 0 warms up (first touch of pages, connections)
        for name, run in runs.items():
            cpu_start, start = cpu_clocks(), time.perf_counter()
            run()
            seconds, cpu_end = time.perf_counter() - start, cpu_clocks()
            if round_:
                samples[name].append(seconds)
                for side in range(2):
                    cpu[name][side] += (cpu_end[side] - cpu_start[side]) / repeats
    return {name: (statistics.median(times), cpu[name][0], cpu[name][1]) for name, times in samples.items()}


def memcpy_run(layout: KVLayout, src: torch.Tensor, runs: list[BlockRun]) -> Callable[[], None]:
    dst = torch.zeros_like(src)
    # Addresses computed once, as our transport does per frame: the loop times the copies, not KVLayout.
    block_bytes, layer_bytes = layout.block_bytes, layout.layer_bytes
    copies = [(dst.data_ptr() + layer * layer_bytes + r.dst * block_bytes,
               src.data_ptr() + layer * layer_bytes + r.src * block_bytes, r.count * block_bytes)
              for layer in range(layout.num_layers) for r in runs]

    def run() -> None:
        assert dst.numel(), "the closure keeps `dst` (only its address is in `copies`) alive"
        for to, from_, size in copies:
            ctypes.memmove(to, from_, size)

    return run


def ours_run(session: TransferSession, layers: int, pairs: tuple[list[int], list[int]]) -> Callable[[], None]:
    def run() -> None:
        for layer in range(layers):
            session.push(layer, *pairs)
        session.flush(WAIT_S)

    return run


def raw_tcp_run(src: torch.Tensor, nbytes: int, child: Child, conns: int) -> Callable[[], None]:
    """Plain sockets: each of `conns` sends its share of `nbytes` from `src` and waits for one byte back."""
    share = nbytes // conns
    listener = socket.create_server(("127.0.0.1", 0))
    address = "127.0.0.1:%d" % listener.getsockname()[1]
    assert child.send(f"connect {address} {conns} {share}") == "connected"
    listener.settimeout(WAIT_S)
    socks = [listener.accept()[0] for _ in range(conns)]
    listener.close()
    view = host_view(src)  # keeps no reference: `src` lives as long as the benchmark of this layout
    assert len(view) >= share * conns, "the pool holds the bytes of one request"

    def send_share(sock: socket.socket, index: int) -> None:
        sock.sendall(view[index * share:(index + 1) * share])
        if sock.recv(1) != b"k":
            raise RuntimeError("plain-socket receiver went away")

    def run() -> None:
        threads = [threading.Thread(target=send_share, args=(sock, i)) for i, sock in enumerate(socks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)

    return run


def mooncake_run(layout: KVLayout, src: torch.Tensor, runs: list[BlockRun], child: Child) -> Callable[[], None]:
    """A Mooncake TCP batch write of the same runs into the child's registered pool."""
    from mooncake.engine import TransferEngine

    _, port, remote = child.first.split()
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake TransferEngine.initialize failed")
    if engine.register_memory(src.data_ptr(), layout.pool_bytes) != 0:
        raise RuntimeError("mooncake register_memory failed")
    target, base = f"127.0.0.1:{port}", int(remote)
    sources, targets, lengths = [], [], []
    for layer in range(layout.num_layers):
        for r in runs:
            sources.append(src.data_ptr() + layout.block_offset(layer, r.src))
            targets.append(base + layout.block_offset(layer, r.dst))
            lengths.append(r.count * layout.block_bytes)

    def run() -> None:
        if engine.batch_transfer_sync_write(target, sources, targets, lengths) != 0:
            raise RuntimeError("mooncake batch_transfer_sync_write failed")

    return run


def start_mooncake(layout: KVLayout) -> Child | str:
    """Mooncake's target process, or why it cannot run here."""
    try:
        import mooncake.engine  # noqa: F401  (the import is what needs libibverbs1)
    except ImportError as exc:
        return (f"mooncake not importable: {exc} "
                "(pip install mooncake-transfer-engine-non-cuda; apt-get install libibverbs1)")
    try:
        return Child("mooncake", layout)
    except RuntimeError as exc:
        return f"mooncake target failed: {exc}"


def bench_layout(layout: KVLayout, repeats: int, variants: list[tuple[int, str]]) -> None:
    rng = random.Random(0)
    pairs = (rng.sample(range(layout.num_blocks), BLOCKS_PER_REQUEST),
             rng.sample(range(layout.num_blocks), BLOCKS_PER_REQUEST))
    runs = merge_runs(*pairs)
    nbytes = layout.num_layers * BLOCKS_PER_REQUEST * layout.block_bytes
    src = torch.randn(layout.shape).to(layout.torch_dtype)
    prefill = create_transport("tcp", src, layout, "prefill", "prefill")  # the default: takes what each variant offers
    address = prefill.start("127.0.0.1", 0)
    decode = Child("decode", layout)
    sinks = {conns: Child("sink", layout) for conns in RAW_CONNECTIONS}
    mooncake = start_mooncake(layout)
    try:
        candidates = {"memcpy (1 thread)": memcpy_run(layout, src, runs)}
        for conns, sink in sinks.items():
            candidates[f"plain sockets, {conns} conns"] = raw_tcp_run(src, nbytes, sink, conns)
        if isinstance(mooncake, Child):
            candidates["mooncake tcp"] = mooncake_run(layout, src, runs, mooncake)
        for i, (conns, checksum) in enumerate(variants):
            assert decode.send(f"link {address} {conns} {checksum} decode-{i}") == "linked"
            session = prefill.session(f"decode-{i}", timeout=WAIT_S)
            candidates[f"ours tcp conns={conns} {checksum}"] = ours_run(session, layout.num_layers, pairs)
        children = [decode, *sinks.values(), *([mooncake] if isinstance(mooncake, Child) else [])]
        freeze_startup_heap()  # as a serving worker does
        measured = interleaved(candidates, repeats,
                               lambda: (time.process_time(), sum(child.cpu_seconds() for child in children)))
    finally:
        decode.stop()
        for sink in sinks.values():
            sink.stop()
        if isinstance(mooncake, Child):
            mooncake.stop()
        prefill.close()
    rate = {name: nbytes / seconds / 1e9 for name, (seconds, _, _) in measured.items()}
    ceiling = max(rate[f"plain sockets, {conns} conns"] for conns in RAW_CONNECTIONS)
    print(f"\nblock_size={layout.block_size} ({layout.block_bytes >> 10} KiB/block) layers={layout.num_layers} "
          f"moved={nbytes / 2**20:.0f} MiB per request in {len(runs)} runs/layer")
    if isinstance(mooncake, str):
        print(f"  mooncake tcp: n/a: {mooncake}")
    for name, gbps in rate.items():
        ratios = f"{gbps / rate['memcpy (1 thread)']:5.2f}x memcpy  {gbps / ceiling:5.2f}x sockets"
        if "mooncake tcp" in rate:
            ratios += f"  {gbps / rate['mooncake tcp']:5.2f}x mooncake"
        sender, receiver = (cpu_seconds / (nbytes / 1e9) for cpu_seconds in measured[name][1:])
        print(f"  {name:26s} {gbps:6.2f} GB/s  {ratios}  {sender + receiver:5.2f} CPU s/GB "
              f"(sender {sender:4.2f}, receiver {receiver:4.2f})")


CHILDREN: dict[str, Callable[[KVLayout], None]] = {"decode": child_decode, "sink": child_sink, "mooncake": child_mooncake}


def _ints(text: str) -> list[int]:
    return [int(item) for item in text.split(",")]


def _variants(text: str) -> list[tuple[int, str]]:
    """"1:XXH3,2:AUTO" -> [(1, "XXH3"), (2, "AUTO")], checked against ChecksumKind."""
    variants = []
    kinds = [AUTO, *ChecksumKind.__members__]
    for item in text.split(","):
        conns, _, checksum = item.partition(":")
        if checksum not in kinds or not conns.isdigit():
            raise argparse.ArgumentTypeError(f"variant {item!r} is not CONNS:{'|'.join(kinds)}")
        variants.append((int(conns), checksum))
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one layout, fewer variants")
    parser.add_argument("--block-sizes", type=_ints, default=[16, 64], help="tokens per block, comma separated")
    parser.add_argument("--layers", type=_ints, default=[8, 24], help="layer counts, comma separated")
    parser.add_argument("--variants", type=_variants, default=_variants("1:AUTO,1:XXH3,2:AUTO,2:XXH3,4:XXH3,2:CRC32"),
                        help="connections:checksum pairs of our transport, comma separated")
    parser.add_argument("--multiturn", action="store_true",
                        help="then KV bytes per turn of a PD pair, prefix reuse off and on (bench_multiturn.py)")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        layout = KVLayout.from_dict(json.loads(args.layout))
        CHILDREN[args.child](layout)
        return
    layouts = [replace(BASE, block_size=bs, num_layers=layers) for bs in args.block_sizes for layers in args.layers]
    variants = args.variants
    if args.quick:
        layouts, variants = layouts[:1], variants[:2]
    print(f"torch {torch.__version__}, {BLOCKS_PER_REQUEST} random blocks per request, median of {args.repeats}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for layout in layouts:
        bench_layout(layout, args.repeats, variants)
    print(f"\nload average at the end of the transfers {os.getloadavg()[0]:.1f}")
    if args.multiturn:
        import bench_multiturn  # benchmarks/ is this script's folder (sys.path[0])

        if bench_multiturn.run_and_print(bench_multiturn.parse_args([])) != 0:
            sys.exit(1)
        print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
