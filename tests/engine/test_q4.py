"""Projections served from 4-bit codes (models/q4.py, csrc/q4_linear.c): found only where
exact, the same matmul as the float32 weights, and what a CPU engine runs for small steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from disagg.workers.engine.config import EngineConfig
from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.loader import load_model
from disagg.workers.engine.models import q4
from disagg.workers.engine.models.packing import Q4_MAX_ROWS, PackedLinear, packing_available
from disagg.workers.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
pytestmark = [
    pytest.mark.skipif(not q4.is_available(), reason="no C compiler to build the CPU kernels"),
    pytest.mark.skipif(not packing_available(CPU, torch.float32), reason="this torch has no oneDNN linear"),
]


def snap_to_grid(weight: torch.Tensor) -> torch.Tensor:
    """The weight moved onto a Q4_1 grid: each group of 32 along a row is d * q + m, d and m in fp16."""
    groups = weight.reshape(weight.shape[0], -1, q4.GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    d = ((high - low) / q4.LEVELS).half().float()
    m = low.half().float()
    q = ((groups - m) / d).round().clamp(0, q4.LEVELS)
    return (d * q + m).reshape(weight.shape)


def decode_codes(grid: q4.Q4Weight) -> torch.Tensor:
    codes = grid.codes.reshape(grid.codes.shape[0], -1, q4.GROUP // 2)
    q = torch.cat([codes & 0x0F, codes >> 4], -1).float()  # [N, K/32, 32]
    d, m = grid.scales[..., :1], grid.scales[..., 1:]
    return (d * q + m).reshape(grid.codes.shape[0], -1)


def test_a_weight_on_the_grid_is_found_exactly() -> None:
    weight = snap_to_grid(torch.randn(48, 96, generator=torch.Generator().manual_seed(0)))
    grid = q4.q4_grid(weight)
    assert grid is not None
    assert grid.codes.shape == (48, 48) and grid.codes.dtype == torch.uint8
    assert grid.scales.shape == (48, 3, 2)
    assert torch.equal(decode_codes(grid), weight)


def test_weights_off_the_grid_are_left_alone() -> None:
    weight = snap_to_grid(torch.randn(16, 64, generator=torch.Generator().manual_seed(1)))
    assert q4.q4_grid(torch.randn(16, 64)) is None, "random float32 weights"
    nudged = weight.clone()
    nudged[3, 17] = torch.nextafter(nudged[3, 17], torch.tensor(1.0))
    assert q4.q4_grid(nudged) is None, "one weight one ulp off its grid"
    assert q4.q4_grid(weight.bfloat16()) is None
    assert q4.q4_grid(snap_to_grid(torch.randn(16, 64))[:, :40]) is None, "rows not in groups of 32"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_q4_linear_equals_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = snap_to_grid(torch.randn(80, 128, generator=gen))
    b = torch.randn(80, generator=gen) if bias else None
    x = torch.randn(rows, 128, generator=gen)
    grid = q4.q4_grid(weight)
    assert grid is not None
    got = q4.q4_linear(x, grid, b)
    assert got.shape == (rows, 80) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)


def test_packed_linear_serves_small_steps_from_the_codes() -> None:
    weight = snap_to_grid(torch.randn(64, 96, generator=torch.Generator().manual_seed(2)))
    layer = PackedLinear(weight, None)
    assert layer.q4 is not None
    assert PackedLinear(torch.randn(64, 96), None).q4 is None
    for rows in (1, Q4_MAX_ROWS, Q4_MAX_ROWS + 1):  # the codes, then oneDNN's packed float32
        x = torch.randn(rows, 96)
        torch.testing.assert_close(layer(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_an_engine_on_grid_weights_decodes_as_the_float32_path(tiny_model: Callable[..., Path]) -> None:
    path = str(tiny_model("llama"))
    loaded = load_model(path, torch.float32, CPU)
    with torch.no_grad():
        for module in loaded.model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(snap_to_grid(module.weight))
    engine = LLMEngine(EngineConfig(model=path, device="cpu", num_kv_blocks=32, block_size=4), loaded)
    layers = [m for m in engine.model_runner.model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.q4 is not None for m in layers)
    prompts = [[5, 17, 42, 7, 9], [3, 3, 8], [11, 2, 60, 61, 62, 1, 4]]

    def greedy() -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"q4-{i}-{id(params)}", prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests:
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return [tokens[k] for k in sorted(tokens)]

    free = engine.num_free_blocks
    from_codes = greedy()
    for layer in layers:
        layer.q4 = None
    assert greedy() == from_codes
    assert engine.num_free_blocks == free
