"""The engine's configuration: one frozen dataclass, validated on creation."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from disagg.proto.vocabulary import DEVICES, DTYPES
from disagg.workers.engine.sampling_params import SEED_RANGE

# NOTE: torch is imported where it is used, so that the CLI (`disagg --help`)
# can read these choices and defaults without loading it.
if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Without a block count or a budget, the KV pool takes this much memory on a CPU.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# ...and this fraction of the free memory left on a GPU after the weights load.
DEFAULT_GPU_KV_CACHE_FRACTION = 0.85
# CPU features that run bf16 matmuls natively (Intel AMX, AVX-512 BF16 on Intel and AMD Zen 4+).
NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The x86 feature flags of /proc/cpuinfo; empty where there are none to read
    (not Linux, no /proc, or a CPU that lists "Features" instead)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))


@functools.cache
def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU computes in bf16 natively. There, the engine served bf16
    1.15x to 1.5x faster than fp32 (docs/benchmarks-engine.md); without it bf16 is
    emulated, and served about 9x slower than fp32 on an AVX2 CPU (docs/benchmarks.md).
    Without flags to read: fp32, which is fast everywhere."""
    return not NATIVE_BF16_FLAGS.isdisjoint(cpu_flags(cpuinfo))


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to run one model.

    The KV pool is sized by `num_kv_blocks` when given, else by
    `kv_cache_memory_bytes`, else by a device default (see kv_cache.py).
    """

    model: str
    device: str = "auto"
    dtype: str = "auto"  # "auto": bfloat16 on CUDA and on CPUs with native bf16, else float32
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    # On a CPU, run the projections from oneDNN-packed weights (models/packing.py).
    pack_cpu_weights: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ValueError("invalid engine config: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        out = []
        if not self.model:
            out.append("model must be given")
        if self.device not in DEVICES:
            out.append(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            out.append(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            out.append(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            out.append(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            out.append(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.max_num_seqs < 1:
            out.append(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            out.append(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            out.append(f"max_model_len must be at least 2, got {self.max_model_len}")
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            out.append(f"seed must be between {SEED_RANGE[0]} and {SEED_RANGE[1]}, got {self.seed}")
        return out

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            chosen = getattr(torch, self.dtype)
            assert isinstance(chosen, torch.dtype), f"{self.dtype} names a torch dtype"
            return chosen
        native_bf16 = self.torch_device.type == "cuda" or cpu_has_native_bf16()
        return torch.bfloat16 if native_bf16 else torch.float32

    def resolve_max_model_len(self, model_max_len: int) -> int:
        """The context length the engine serves: ours, capped by the model's."""
        if self.max_model_len is None:
            return model_max_len
        if self.max_model_len > model_max_len:
            log.warning("max_model_len %d is past the model's %d positions: serving %d", self.max_model_len,
                        model_max_len, model_max_len)
        return min(self.max_model_len, model_max_len)
