"""Paged decode attention on the CPU: csrc/paged_decode.c, built on first use.

The plain path (attention._decode) copies every decode sequence's context into
a padded tensor per layer and step, then runs SDPA over the copy: at 32
sequences of 384 tokens that is three passes over the cache. The kernel reads
each K and V row once, in place through the block tables, for all the query
heads that share it, with an online softmax (the CPU twin of
triton_attention).

It is built with the machine's C compiler (`$CC`, else `cc`) for the CPU it
runs on (-march=native) and cached in ~/.cache/disagg/kernels, keyed by the
source, the flags and the compiler. With no compiler, or a failed build, the
gather path serves and the log says why, once. DISAGG_CPU_ATTENTION=gather
turns the kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# -mprefer-vector-width=256: GCC's AMD Zen tuning would otherwise keep to 128-bit vectors.
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=256", "-fopenmp", "-shared", "-fPIC")
SWITCH_ENV = "DISAGG_CPU_ATTENTION"  # "gather": never use the kernel
PROFILE_LABEL = "disagg::paged_decode_cpu"
_BUILD_TIMEOUT_S = 120.0
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# The kernel's stack buffers (csrc/paged_decode.c); other shapes take the gather path.
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 32, 256, 256

_i32_p = ctypes.POINTER(ctypes.c_int32)
_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, _i32_p, _i32_p, ctypes.c_void_p,
             *[ctypes.c_int] * 6, ctypes.c_float, ctypes.c_int]


def kernel_dir() -> Path:
    from disagg.workers.engine.loader import default_cache_dir

    return default_cache_dir().parent / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _build(compiler: str, out_dir: Path) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version]).encode()).hexdigest()[:16]
    target = out_dir / f"paged_decode-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: workers starting together
    # never load a half-written library.
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        partial = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, "-o", str(partial), str(SOURCE)], check=True, capture_output=True,
                       text=True, timeout=_BUILD_TIMEOUT_S)
        partial.replace(target)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(SWITCH_ENV) == "gather":
        log.info("CPU decode attention: the gather path (%s=gather)", SWITCH_ENV)
        return None
    compiler = _compiler()
    if compiler is None:
        log.info("CPU decode attention: the gather path (no C compiler to build the kernel; set $CC)")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler, kernel_dir())))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("CPU decode attention: the gather path (building the kernel failed: %s)", detail)
        return None
    for dtype_name in _DTYPES.values():
        function = getattr(library, f"paged_decode_{dtype_name}")
        function.argtypes = _ARGTYPES
        function.restype = ctypes.c_int
    log.info("CPU decode attention: the paged kernel")
    return library


def is_available() -> bool:
    """Whether the kernel is built (or can be) on this machine."""
    return _library() is not None


def supports(cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether the kernel serves attention over `cache` (a layer's or the whole model's) with these shapes."""
    shapes_fit = num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP \
        and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK
    return cache.device.type == "cpu" and cache.dtype in _DTYPES and shapes_fit and is_available()


def paged_decode_attention(q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, heads, hd]; layer_cache: [num_blocks, 2, block_size, kvh, hd] (contiguous);
    block_tables: [B, max_blocks] int32; context_lens: [B] int32. Returns [B, heads, hd] in q's dtype."""
    library = _library()
    assert library is not None, "paged_decode_attention needs supports() first"
    assert layer_cache.is_contiguous(), "the kernel reads the cache in place"
    batch, heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = layer_cache.shape
    query = q.to(torch.float32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    function = getattr(library, f"paged_decode_{_DTYPES[layer_cache.dtype]}")
    with torch.profiler.record_function(PROFILE_LABEL):  # named in profiles (benchmarks/profile_step.py)
        status = function(query.data_ptr(), layer_cache.data_ptr(),
                          ctypes.cast(tables.data_ptr(), _i32_p), ctypes.cast(lens.data_ptr(), _i32_p),
                          out.data_ptr(), batch, heads, kv_heads, head_dim, block_size, tables.shape[1], scale,
                          torch.get_num_threads())
    if status != 0:
        raise ValueError(f"paged decode kernel refused its arguments (code {status}): heads {heads}, "
                         f"kv heads {kv_heads}, head dim {head_dim}, block size {block_size}")
    return out.to(q.dtype)
