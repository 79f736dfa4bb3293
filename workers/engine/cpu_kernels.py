"""The engine's C kernels for CPUs (csrc/*.c), built on first use and loaded with ctypes.

They are built with the machine's C compiler (`$CC`, else `cc`) for the CPU
they run on (-march=native), into one library cached in
~/.cache/disagg/kernels under a key made of the sources, the flags and the
compiler. Without a compiler, or after a failed build, `library()` is None and
the engine serves with PyTorch ops instead; the log says why, once.
DISAGG_CPU_KERNELS=off turns them off.

Their OpenMP runtime is the one torch already loaded (the same soname), so
their threads are torch's, sized by torch.get_num_threads().
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(sorted(CSRC.glob("*.c")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))  # in the cache key, not on the command line
# -mprefer-vector-width=256: GCC's AMD Zen tuning would otherwise keep to 128-bit vectors.
# -ffp-contract=off: a dequantised weight is d * q + m with two roundings, as the loader made it.
# -fno-trapping-math: no value changes, only the promise that no one traps on floating-point
# exceptions; without it GCC keeps every loop with a float comparison (a select) scalar.
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=256", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp",
         "-shared", "-fPIC")
SWITCH_ENV = "DISAGG_CPU_KERNELS"  # "off": PyTorch ops only
_BUILD_TIMEOUT_S = 180.0
Kernel = Callable[..., int]  # a C function with its argtypes set; returns its status code
# The element types the kernels take, by the suffix of their C names.
DTYPE_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def kernel_dir() -> Path:
    from disagg.workers.engine.loader import default_cache_dir

    return default_cache_dir().parent / "kernels"


def _build(compiler: str, out_dir: Path) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, *FLAGS, version]).encode()).hexdigest()
    target = out_dir / f"disagg-cpu-{key[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: workers starting together
    # never load a half-written library.
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        partial = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, "-o", str(partial), *map(str, SOURCES)], check=True,
                       capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        partial.replace(target)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None where they cannot be built (see the module's docstring)."""
    switch = os.environ.get(SWITCH_ENV, "on")
    if switch not in ("on", "off"):
        raise ValueError(f"{SWITCH_ENV} must be on or off, got {switch!r}")
    if switch == "off":
        log.info("CPU kernels: off (%s=off); PyTorch ops serve", SWITCH_ENV)
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("CPU kernels: no C compiler to build them (set $CC); PyTorch ops serve")
        return None
    try:
        loaded = ctypes.CDLL(str(_build(compiler, kernel_dir())))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("CPU kernels: the build failed, PyTorch ops serve: %s", getattr(exc, "stderr", None) or exc)
        return None
    log.info("CPU kernels: %s", loaded._name)
    return loaded


def function(name: str, argtypes: list[type], restype: type | None = ctypes.c_int) -> Kernel | None:
    """One kernel of the library with its C signature, or None without the library."""
    loaded = library()
    if loaded is None:
        return None
    kernel = getattr(loaded, name)
    kernel.argtypes = argtypes
    kernel.restype = restype
    return kernel  # type: ignore[no-any-return]


def available_function(name: str, argtypes: list[type], restype: type | None = ctypes.c_int) -> Kernel | None:
    """A kernel that also says whether it can run in this process (`{name}_available()`, 1 when
    it can: AMX kernels need a build with AMX and Linux's leave to use the tiles), or None."""
    kernel = function(name, argtypes, restype)
    available = function(f"{name}_available", [])
    return kernel if kernel is not None and available is not None and available() == 1 else None


def profiled(label: str) -> contextlib.AbstractContextManager[object]:
    """A profiler range named `label` around a kernel call while a profiler records
    (benchmarks/profile_step.py names the kernels by it), else nothing: entering a
    range costs about 8 us, a fifth of a small projection's call."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(label)
    return contextlib.nullcontext()
