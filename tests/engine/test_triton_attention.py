"""The Triton paged decode kernel against the plain PyTorch path.

Without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1,
numpy on CPU tensors): same kernel source, same indexing and masking, so
block-table reads, boundaries and the online softmax are checked here; the
gpu-marked test compiles it for real.

Triton fixes interpreted or compiled execution when it is first imported, and
other test modules import it first (transformers does), so the interpreted
tests run in a child pytest started with the variable set:
test_interpreter_child_run runs them; in the parent they are skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from disagg.workers.engine.attention import build_metadata, decode_kernel
from tests.engine.decode_steps import (
    KV_HEADS, SCALE, attend, context_lens_for, decode_step, mixed_step_through, random_q,
)

pytest.importorskip("triton")
from disagg.workers.engine.triton_attention import paged_decode_attention  # noqa: E402 (after the skip)

torch.set_num_threads(2)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="run in a child by test_interpreter_child_run")


@pytest.mark.skipif(INTERPRETED, reason="this is the child run")
def test_interpreter_child_run() -> None:
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", "test_interp_"],
        cwd=repo, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert " passed" in child.stdout, child.stdout[-2000:]


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@interpreted
def test_interp_matches_plain_path_fp32(paged_cache: type, block_size: int,
                                        group: int, head_dim: int) -> None:
    lens = context_lens_for(block_size)
    layer_cache, batch = decode_step(paged_cache, lens, block_size=block_size, head_dim=head_dim,
                                     dtype=torch.float32, device="cpu")
    q = random_q(len(lens), group, head_dim, torch.float32, "cpu")
    kv = torch.zeros(len(lens), KV_HEADS, head_dim)
    kernel_meta = build_metadata(batch, block_size, kernel=paged_decode_attention)
    plain_meta = build_metadata(batch, block_size)
    assert kernel_meta.decode is not None and kernel_meta.decode.padded is None, "kernel path not chosen"
    assert plain_meta.decode is not None and plain_meta.decode.padded is not None
    # the tables really are shuffled: a kernel ignoring them would read other blocks
    assert not torch.equal(kernel_meta.decode.block_tables[:, 0], torch.arange(len(lens), dtype=torch.int32))

    got = attend(q, kv, layer_cache, kernel_meta)
    want = attend(q, kv, layer_cache, plain_meta)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# Triton 3.9's interpreter gets tl.dot on bf16 operands wrong (a 16x16 product
# is off by 1e10 while fp16 is exact), so bf16 is checked on CUDA only.
BF16_INTERPRETER_BROKEN = pytest.mark.skip(reason="the Triton interpreter's bf16 tl.dot is wrong")


@pytest.mark.parametrize("dtype, atol", [pytest.param(torch.bfloat16, 2e-2, marks=BF16_INTERPRETER_BROKEN),
                                         (torch.float16, 4e-3)])
@interpreted
def test_interp_half_precision(paged_cache: type, dtype: torch.dtype, atol: float) -> None:
    """16-bit cache and queries against the plain path in fp32 on the same (rounded) values."""
    block_size, group, head_dim = 4, 3, 64
    lens = context_lens_for(block_size)
    layer_cache, batch = decode_step(paged_cache, lens, block_size=block_size, head_dim=head_dim,
                                     dtype=dtype, device="cpu")
    q = random_q(len(lens), group, head_dim, dtype, "cpu")
    kv = torch.zeros(len(lens), KV_HEADS, head_dim)
    got = attend(q, kv.to(dtype), layer_cache, build_metadata(batch, block_size, kernel=paged_decode_attention))
    want = attend(q.float(), kv, layer_cache.float(), build_metadata(batch, block_size))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)


@interpreted
def test_interp_mixed_step(paged_cache: type) -> None:
    """Decode rows among a prefill's rows: the kernel's output lands in the decode rows only."""
    got, want = mixed_step_through(paged_decode_attention, paged_cache)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_metadata_without_a_kernel_takes_the_padded_gather(paged_cache: type) -> None:
    layer_cache, batch = decode_step(paged_cache, [5], block_size=4, head_dim=32,
                                     dtype=torch.float32, device="cpu")
    meta = build_metadata(batch, 4)
    assert meta.decode is not None and meta.decode.padded is not None and meta.decode.kernel is None
    assert meta.decode.block_tables.dtype == torch.int32 and meta.decode.context_lens.tolist() == [5]


def test_kernel_rejects_mismatched_inputs() -> None:
    """Checked before any launch, so this runs in the parent too."""
    cache = torch.zeros(4, 2, 4, KV_HEADS, 32)
    tables = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(torch.zeros(2, 6, 32), cache, tables.long(), lens, SCALE)
    with pytest.raises(ValueError, match="does not match"):
        paged_decode_attention(torch.zeros(2, 5, 32), cache, tables, lens, SCALE)
    with pytest.raises(ValueError, match="does not match"):
        paged_decode_attention(torch.zeros(2, 6, 64), cache, tables, lens, SCALE)
    with pytest.raises(ValueError, match="3 queries"):
        paged_decode_attention(torch.zeros(3, 6, 32), cache, tables, lens, SCALE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_kernel_on_cuda(monkeypatch: pytest.MonkeyPatch, paged_cache: type, block_size: int,
                        dtype: torch.dtype, atol: float) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    group, head_dim = 3, 64
    lens = context_lens_for(block_size) + [300]
    layer_cache, batch = decode_step(paged_cache, lens, block_size=block_size, head_dim=head_dim,
                                     dtype=dtype, device="cuda")
    q = random_q(len(lens), group, head_dim, dtype, "cuda")
    kv = torch.zeros(len(lens), KV_HEADS, head_dim, device="cuda")
    meta = build_metadata(batch, block_size, decode_kernel(layer_cache, KV_HEADS * group))
    assert meta.decode is not None and meta.decode.kernel is paged_decode_attention, \
        "CUDA with Triton must take the kernel"
    got = attend(q, kv.to(dtype), layer_cache, meta)
    want = attend(q.float(), kv, layer_cache.float(), build_metadata(batch, block_size))
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)
