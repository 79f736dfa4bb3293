"""The KV transfer interface: pool layout, block runs, transports and sessions.

The KV cache of a worker is ONE tensor (the "pool"), written down here once:

    pool: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]   (2 = K and V)

so the K and V of one block of one layer is one contiguous run of
`KVLayout.block_bytes` bytes, and consecutive block ids of a layer are adjacent
in memory. A transfer moves, for one request, the blocks `src_blocks[i]` of one
pool into the blocks `dst_blocks[i]` of another, for one layer (PUSH, as soon
as the prefill's forward has written it) or for every layer (PULL).
"""

from __future__ import annotations

import functools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from disagg.workers.transfer.access import BlockAccess


class TransferError(RuntimeError):
    """A transfer failed (peer error, checksum mismatch, connection lost)."""


class TransferTimeout(TransferError):
    """A bounded wait on a transfer or a peer ran out."""


class LinkRefusedError(TransferError):
    """The peer refused the link (e.g. the KV layouts differ); `str()` is its reason."""


@dataclass(frozen=True)
class KVLayout:
    """What a KV pool looks like; two pools exchange blocks only when these agree.

    `num_blocks` is the one field allowed to differ between peers: each side
    sizes its own pool, and block ids are validated against the owner's count.
    """

    model: str
    dtype: str  # a torch dtype name without the "torch." prefix, e.g. "float16"
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("KVLayout.model must name the model")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not a torch dtype name")
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @classmethod
    def of_pool(cls, pool: torch.Tensor, model: str) -> KVLayout:
        """The layout of an existing pool tensor (which must be contiguous)."""
        if pool.dim() != 6 or pool.shape[2] != 2:
            raise ValueError(
                "a KV pool is [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim], "
                f"got shape {tuple(pool.shape)}"
            )
        if not pool.is_contiguous():
            raise ValueError("a KV pool must be contiguous: transfers address it by byte offsets")
        layers, blocks, _, block_size, heads, head_dim = pool.shape
        return cls(model, str(pool.dtype).removeprefix("torch."), layers, blocks, block_size, heads, head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype)
        assert isinstance(dtype, torch.dtype), f"validated in __post_init__: {self.dtype}"
        return dtype

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def element_size(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V of one block of one layer: the unit every transfer moves."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def layer_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def pool_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def block_offset(self, layer: int, block: int) -> int:
        """Byte offset of (layer, block) from the start of the pool."""
        return layer * self.layer_bytes + block * self.block_bytes

    def mismatch_reason(self, peer: KVLayout) -> str | None:
        """Why blocks of `peer` cannot be copied into this layout, or None when they can."""
        reasons = [
            f"{f.name}: ours {getattr(self, f.name)!r}, peer {getattr(peer, f.name)!r}"
            for f in fields(self)
            if f.name != "num_blocks" and getattr(self, f.name) != getattr(peer, f.name)
        ]
        return "KV layout mismatch (" + "; ".join(reasons) + ")" if reasons else None

    def check_pool(self, pool: torch.Tensor) -> None:
        """Raise ValueError unless `pool` is a contiguous tensor of exactly this layout."""
        if tuple(pool.shape) != self.shape or pool.dtype != self.torch_dtype or not pool.is_contiguous():
            raise ValueError(
                f"pool {tuple(pool.shape)} {pool.dtype} (contiguous={pool.is_contiguous()}) "
                f"does not match layout {self.shape} {self.torch_dtype}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise ValueError(f"a KV layout needs exactly the keys {sorted(names)}, got {data!r}")
        return cls(**data)


@dataclass(frozen=True)
class PeerInfo:
    """Who is at the other end of a link, as announced in its handshake."""

    name: str  # "<ip>:<grpc port>" of the peer's DisaggPDService
    grpc_address: str
    layout: KVLayout


@dataclass(frozen=True)
class BlockRun:
    """`count` consecutive blocks from `src` copied to `count` consecutive blocks at `dst`."""

    src: int
    dst: int
    count: int


def merge_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[BlockRun]:
    """Pair up block ids and merge neighbours that are consecutive on both sides.

    Order is kept: pair i lands in the run that covers it, runs in pair order.
    """
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    runs: list[BlockRun] = []
    for src, dst in zip(src_blocks, dst_blocks):
        if src < 0 or dst < 0:
            raise ValueError(f"negative block id in pair ({src}, {dst})")
        last = runs[-1] if runs else None
        if last is not None and src == last.src + last.count and dst == last.dst + last.count:
            runs[-1] = BlockRun(last.src, last.dst, last.count + 1)
        else:
            runs.append(BlockRun(int(src), int(dst), 1))
    return runs


def split_runs(runs: Sequence[BlockRun], parts: int) -> list[list[BlockRun]]:
    """Cut `runs` into at most `parts` non-empty groups of nearly equal block counts.

    Runs are split where a group boundary falls inside them, so one long run
    still spreads over several connections.
    """
    assert parts >= 1, f"split_runs needs at least one part, got {parts}"
    total = sum(run.count for run in runs)
    if total == 0:
        return []
    parts = min(parts, total)
    groups: list[list[BlockRun]] = [[] for _ in range(parts)]
    quotas = [total // parts + (1 if i < total % parts else 0) for i in range(parts)]
    group = 0
    for run in runs:
        offset = 0
        while offset < run.count:
            take = min(quotas[group], run.count - offset)
            groups[group].append(BlockRun(run.src + offset, run.dst + offset, take))
            quotas[group] -= take
            offset += take
            if quotas[group] == 0:
                group += 1
    return groups


def check_runs(runs: Sequence[BlockRun], src_blocks: int, dst_blocks: int) -> None:
    """Raise ValueError when a run leaves the source or destination pool."""
    for run in runs:
        if run.count <= 0 or run.src < 0 or run.dst < 0:
            raise ValueError(f"invalid block run {run}")
        if run.src + run.count > src_blocks:
            raise ValueError(f"source blocks {run.src}..{run.src + run.count - 1} out of range ({src_blocks} blocks)")
        if run.dst + run.count > dst_blocks:
            raise ValueError(
                f"destination blocks {run.dst}..{run.dst + run.count - 1} out of range ({dst_blocks} blocks)"
            )


@functools.lru_cache(maxsize=64)
def plan_runs(src_blocks: tuple[int, ...], dst_blocks: tuple[int, ...], src_pool_blocks: int,
              dst_pool_blocks: int, parts: int) -> tuple[tuple[BlockRun, ...], ...]:
    """`merge_runs`, `check_runs` and `split_runs` of one transfer, remembered.

    A prefill pushes the same block lists once per layer, and each plan costs
    about 100 us of Python under the GIL its sender threads need: the cache
    makes every layer after the first cost a dictionary look-up. Raises
    ValueError as `merge_runs` and `check_runs` do (failures are not cached).
    """
    runs = merge_runs(src_blocks, dst_blocks)
    check_runs(runs, src_pool_blocks, dst_pool_blocks)
    return tuple(tuple(part) for part in split_runs(runs, parts))


class TransferHandle:
    """Completion of one push or pull, which may travel as several parts (one per connection).

    Invariant: done once every part reported, failed as soon as one part failed
    (the first reason wins). Thread-safe: parts complete on transport threads.
    """

    def __init__(self, parts: int, nbytes: int) -> None:
        assert parts >= 0, f"a transfer has a non-negative number of parts, got {parts}"
        self.nbytes = nbytes
        self.started_at = time.monotonic()
        self.finished_at: float | None = None  # time.monotonic() once done (for traces)
        self._left = parts
        self._error: str | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        if parts == 0:
            self._finish()

    def part_done(self, error: str | None = None) -> None:
        """Report one part; `error` is a reason when that part failed."""
        with self._lock:
            if self._done.is_set():
                return
            self._left -= 1
            if error is not None:
                self._error = error
            if error is not None or self._left == 0:
                self._finish()

    def _finish(self) -> None:
        self.finished_at = time.monotonic()
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def failed(self) -> bool:
        return self._done.is_set() and self._error is not None

    def wait(self, timeout: float) -> None:
        """Block until done. Raises TransferTimeout after `timeout` s, TransferError on failure."""
        if not self._done.wait(timeout):
            raise TransferTimeout(f"transfer of {self.nbytes} bytes not done after {timeout:.1f}s")
        if self._error is not None:
            raise TransferError(self._error)


class PendingTransfers:
    """The handles a session started that `flush` has not reported yet.

    Invariant: a handle leaves only when it succeeded or a flush raised its
    failure, so a failed push is never silently forgotten.
    """

    def __init__(self) -> None:
        self._handles: list[TransferHandle] = []
        self._lock = threading.Lock()

    def add(self, handle: TransferHandle) -> None:
        with self._lock:
            self._handles = [h for h in self._handles if not h.done() or h.failed] + [handle]

    def wait_all(self, timeout: float, peer_name: str) -> None:
        """Wait for every pending handle; raise the first failure or a timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            handles = list(self._handles)
        try:
            for handle in handles:
                remaining = deadline - time.monotonic()
                if remaining <= 0 and not handle.done():
                    raise TransferTimeout(f"transfers with {peer_name} not done after {timeout:.1f}s")
                handle.wait(max(remaining, 0.0))
        finally:
            with self._lock:
                self._handles = [h for h in self._handles if not h.done()]


class TransferSession(ABC):
    """One link to one peer, able to move blocks between the two pools.

    Ownership: the session owns its connections (or IPC mappings, or
    communicator) and closes them in `close`. It never allocates or frees
    blocks: the caller keeps the source blocks unchanged and leaves the
    destination blocks unused until the handle of the transfer is done.
    Block ids are validated against each pool's own `num_blocks`.
    """

    peer: PeerInfo

    @abstractmethod
    def push(self, layer: int, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> TransferHandle:
        """Start copying one layer of local `src_blocks` into the peer's `dst_blocks`.

        Returns at once (the copy overlaps the next layer's compute). On a
        CUDA pool the copy waits for the work queued so far on the current
        stream, so call it right after the forward has written `layer`.

        Args:
            layer: layer index, 0 <= layer < num_layers.
            src_blocks: block ids in the local pool.
            dst_blocks: block ids in the peer's pool, same length.
        Returns:
            a handle that is done once the peer has stored and checked the bytes.
        """

    @abstractmethod
    def pull(self, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> TransferHandle:
        """Start copying every layer of the peer's `src_blocks` into local `dst_blocks`.

        Returns:
            a handle that is done once the bytes are stored locally and checked.
        """

    @abstractmethod
    def flush(self, timeout: float) -> None:
        """Wait until every push and pull started on this session is done.

        Raises TransferTimeout after `timeout` seconds, TransferError if any failed.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the link; pending transfers fail. Idempotent."""

    @property
    @abstractmethod
    def is_open(self) -> bool:
        """False once closed by either side or broken."""


class KVTransport(ABC):
    """One per worker: exposes the worker's KV pool to peers and opens sessions to them.

    Ownership: the pool tensor belongs to the engine; the transport only
    reads and writes the blocks its sessions are told to. A link is opened by
    the decode (`connect`, sending a handshake with its name, gRPC address and
    layout); the prefill checks the layout, refuses a mismatch with a reason,
    and learns the peer (`session`, `on_link`).
    """

    name: str  # the registry key, e.g. "tcp"

    def __init__(self, pool: torch.Tensor, layout: KVLayout, instance_name: str, grpc_address: str) -> None:
        layout.check_pool(pool)
        self.pool = pool
        self.layout = layout
        self.instance_name = instance_name
        self.grpc_address = grpc_address
        # Which blocks each peer may touch; unchecked unless a subclass is given an enforcing one.
        self.access = BlockAccess(enforce=False)
        # Called on a transport thread with each peer whose handshake was accepted.
        self.on_link: Callable[[TransferSession], None] | None = None

    @property
    def identity(self) -> PeerInfo:
        return PeerInfo(self.instance_name, self.grpc_address, self.layout)

    @abstractmethod
    def start(self, host: str, port: int) -> str:
        """Listen for peers on host:port (0 picks a free port). Returns the bound "host:port"."""

    @abstractmethod
    def connect(self, address: str, timeout: float, expect_name: str | None = None) -> TransferSession:
        """Open the data path to the peer listening at `address` and handshake.

        Args:
            expect_name: the instance the link names; a peer answering under
                another name is refused.
        Raises LinkRefusedError with the peer's reason when it refuses (a
        layout mismatch names the fields that differ; a wrong cluster key only
        "authentication failed"), TransferTimeout when it does not answer within `timeout`.
        """

    @abstractmethod
    def session(self, peer_name: str, timeout: float) -> TransferSession:
        """The session a peer named `peer_name` opened to us, waiting up to `timeout` s for it."""

    @abstractmethod
    def peers(self) -> dict[str, PeerInfo]:
        """Peers currently linked to us by their handshakes, by instance name."""

    @abstractmethod
    def close(self) -> None:
        """Stop listening and close every session. Idempotent."""
