"""Projections served from the codes of a quantisation grid (models/grids.py,
csrc/grid_linear.c): found only where exact, the same matmul as the float32
weights, and what a CPU engine runs for small steps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from disagg.workers.engine.config import EngineConfig
from disagg.workers.engine.llm_engine import LLMEngine
from disagg.workers.engine.loader import LoadedModel, load_model, read_safetensors
from disagg.workers.engine.model_config import ModelConfig
from disagg.workers.engine.models import grids, model_class, panels
from disagg.workers.engine.models.grids import GridFormat
from disagg.workers.engine.models.packing import GRID_MAX_ROWS, PackedLinear, packing_available
from disagg.workers.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
pytestmark = [
    pytest.mark.skipif(not grids.is_available(), reason="no C compiler to build the CPU kernels"),
    pytest.mark.skipif(not packing_available(CPU, torch.float32), reason="this torch has no oneDNN linear"),
]


def snap_to_grid(weight: torch.Tensor, grid: GridFormat) -> torch.Tensor:
    """The weight moved onto a grid as llama.cpp quantises it: each group of 32 along a row is
    d * q + m (Q4_1) or d * q (Q8_0), d and m in fp16."""
    groups = weight.reshape(weight.shape[0], -1, grids.GROUP)
    if grid is GridFormat.Q8_0:
        d = (groups.abs().amax(-1, keepdim=True) / grids.Q8_LIMIT).half().float()
        return (d * (groups / d).round()).reshape(weight.shape)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    d = ((high - low) / grids.Q4_LEVELS).half().float()
    m = low.half().float()
    q = ((groups - m) / d).round().clamp(0, grids.Q4_LEVELS)
    return (d * q + m).reshape(weight.shape)


def decode_codes(grid: grids.GridWeight) -> torch.Tensor:
    rows = grid.codes.shape[0]
    if grid.format is GridFormat.Q8_0:
        q = grid.codes.reshape(rows, -1, grids.GROUP).float()
        return (grid.scales.unsqueeze(-1) * q).reshape(rows, -1)
    codes = grid.codes.reshape(rows, -1, grids.GROUP // 2)
    q = torch.cat([codes & 0x0F, codes >> 4], -1).float()  # [N, K/32, 32]
    d, m = grid.scales[..., :1], grid.scales[..., 1:]
    return (d * q + m).reshape(rows, -1)


@pytest.mark.parametrize(("fmt", "codes_shape", "scales_shape", "codes_dtype"), [
    (GridFormat.Q4_1, (48, 48), (48, 3, 2), torch.uint8),
    (GridFormat.Q8_0, (48, 96), (48, 3), torch.int8),
])
def test_a_weight_on_a_grid_is_found_exactly(fmt: GridFormat, codes_shape: tuple[int, ...],
                                              scales_shape: tuple[int, ...], codes_dtype: torch.dtype) -> None:
    weight = snap_to_grid(torch.randn(48, 96, generator=torch.Generator().manual_seed(0)), fmt)
    grid = grids.find_grid(weight)
    assert grid is not None and grid.format is fmt
    assert grid.codes.shape == codes_shape and grid.codes.dtype == codes_dtype
    assert grid.scales.shape == scales_shape
    assert grid.in_features == 96
    assert torch.equal(decode_codes(grid), weight)


@pytest.mark.parametrize("fmt", list(GridFormat))
def test_weights_off_the_grid_are_left_alone(fmt: GridFormat) -> None:
    weight = snap_to_grid(torch.randn(16, 64, generator=torch.Generator().manual_seed(1)), fmt)
    assert grids.find_grid(torch.randn(16, 64)) is None, "random float32 weights"
    nudged = weight.clone()
    nudged[3, 17] = torch.nextafter(nudged[3, 17], torch.tensor(1.0))
    assert grids.find_grid(nudged) is None, "one weight one ulp off its grid"
    assert grids.find_grid(weight.bfloat16()) is None
    assert grids.find_grid(snap_to_grid(torch.randn(16, 64), fmt)[:, :40]) is None, "rows not in groups of 32"


@pytest.mark.parametrize("fmt", list(GridFormat))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_grid_linear_equals_f_linear(fmt: GridFormat, rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = snap_to_grid(torch.randn(80, 128, generator=gen), fmt)
    b = torch.randn(80, generator=gen) if bias else None
    x = torch.randn(rows, 128, generator=gen)
    grid = grids.find_grid(weight)
    assert grid is not None and grid.format is fmt
    got = grids.grid_linear(x, grid, b)
    assert got.shape == (rows, 80) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", list(GridFormat))
def test_packed_linear_serves_small_steps_from_the_codes(fmt: GridFormat) -> None:
    weight = snap_to_grid(torch.randn(64, 96, generator=torch.Generator().manual_seed(2)), fmt)
    layer = PackedLinear(weight, None)
    assert layer.grid is not None and layer.grid.format is fmt
    assert PackedLinear(torch.randn(64, 96), None).grid is None
    most = GRID_MAX_ROWS[fmt, torch.float32]
    for rows in (1, most, most + 1):  # the codes, then our float32 panels
        x = torch.randn(rows, 96)
        torch.testing.assert_close(layer(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_an_engine_on_grid_weights_decodes_as_the_float32_path(tiny_model: Callable[..., Path]) -> None:
    """The embedded default's shape: decoder projections on Q4_1, the embedding (tied to the
    output projection) on Q8_0."""
    path = str(tiny_model("llama", tied=True))
    loaded = load_model(path, torch.float32, CPU)
    with torch.no_grad():
        for module in loaded.model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(snap_to_grid(module.weight, GridFormat.Q4_1))
        embedding = loaded.model.model.embed_tokens.weight
        embedding.copy_(snap_to_grid(embedding, GridFormat.Q8_0))
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=32, block_size=4), loaded)
    model = engine.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert model.lm_head.grid is not None and model.lm_head.grid.format is GridFormat.Q8_0
    assert all(m.grid is not None and m.grid.format is GridFormat.Q4_1 for m in layers if m is not model.lm_head)
    prompts = [[5, 17, 42, 7, 9], [3, 3, 8], [11, 2, 60, 61, 62, 1, 4]]

    def greedy() -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"grid-{i}-{id(params)}", prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests:
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return [tokens[k] for k in sorted(tokens)]

    free = engine.num_free_blocks
    from_codes = greedy()
    for layer in layers:
        layer.grid = None
    assert greedy() == from_codes
    assert engine.num_free_blocks == free


def test_source_grids_join_the_shards_of_a_fused_weight() -> None:
    """q, k and v load into one weight: its codes are theirs, in row order, only when every
    row came from one grid."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (snap_to_grid(torch.randn(rows, 64, generator=gen), GridFormat.Q4_1) for rows in (32, 16, 16))
    found = grids.SourceGrids()
    for first, shard in ((48, v), (0, q), (32, k)):  # in any order
        found.offer("qkv", first, shard)
    fused = found.found({"qkv": 64})["qkv"]
    whole = grids.find_grid(torch.cat([q, k, v]))
    assert whole is not None and fused.format is whole.format
    assert torch.equal(fused.codes, whole.codes) and torch.equal(fused.scales, whole.scales)

    off_grid, short, mixed = grids.SourceGrids(), grids.SourceGrids(), grids.SourceGrids()
    off_grid.offer("qkv", 0, q)
    off_grid.offer("qkv", 32, torch.randn(32, 64, generator=gen))
    short.offer("qkv", 0, q)
    short.offer("qkv", 48, v)  # rows 32..48 never came
    mixed.offer("qkv", 0, q)
    mixed.offer("qkv", 32, snap_to_grid(torch.randn(32, 64, generator=gen), GridFormat.Q8_0))
    for partial in (off_grid, short, mixed):
        assert partial.found({"qkv": 64}) == {}
    assert found.found({"qkv": 80}) == {}, "rows the shards did not cover"


@pytest.fixture
def bf16_by_onednn(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """bf16 projections by oneDNN alone (DISAGG_CPU_LINEAR=onednn), as on a CPU without our bf16
    kernels (which keep small bf16 steps where they run): the codes serve small steps."""
    monkeypatch.setenv(panels.SWITCH_ENV, "onednn")
    panels.preferred.cache_clear()
    yield
    monkeypatch.delenv(panels.SWITCH_ENV)
    panels.preferred.cache_clear()


needs_onednn_bf16 = pytest.mark.skipif(not packing_available(CPU, torch.bfloat16), reason="oneDNN has no bf16 here")


@needs_onednn_bf16
@pytest.mark.parametrize("fmt", list(GridFormat))
def test_a_bf16_projection_from_the_codes_keeps_the_exact_weights(fmt: GridFormat, bf16_by_onednn: None) -> None:
    """The bf16 cast rounds every weight; the codes hold them exactly, so a small step is the
    float32 matmul rounded once, closer to it than the bf16 weights' own."""
    gen = torch.Generator().manual_seed(4)
    weight = snap_to_grid(torch.randn(96, 128, generator=gen), fmt)
    bias = torch.randn(96, generator=gen)
    layer = PackedLinear(weight.bfloat16(), bias.bfloat16(), grids.find_grid(weight))
    assert layer.grid is not None and layer.grid.format is fmt
    for rows in (1, GRID_MAX_ROWS[fmt, torch.bfloat16]):
        x = torch.randn(rows, 128, generator=gen).bfloat16()
        exact = F.linear(x.float(), weight, bias.bfloat16().float())
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
        torch.testing.assert_close(got.float(), exact, rtol=2 ** -8, atol=1e-6)
        rounded_weights = F.linear(x, weight.bfloat16(), bias.bfloat16()).float()
        assert (got.float() - exact).abs().mean() < (rounded_weights - exact).abs().mean()


def checkpoint_on_grids(path: Path) -> list[tuple[str, torch.Tensor]]:
    """The tiny model's tensors moved onto grids as a GGUF's arrive: Q8_0 embedding, Q4_1 decoder."""
    return [(name, snap_to_grid(t, GridFormat.Q8_0 if "embed_tokens" in name else GridFormat.Q4_1)
             if t.dim() == 2 else t) for name, t in read_safetensors(path)]


@pytest.mark.skipif(not panels.preferred(torch.bfloat16), reason="no bf16 kernel of ours runs here")
def test_a_bf16_model_does_not_look_for_codes_where_our_bf16_kernel_serves(tiny_model: Callable[..., Path]) -> None:
    path = tiny_model("llama", tied=True)
    config = ModelConfig.from_dir(path)
    model = model_class(config.architecture).create(config, torch.bfloat16, CPU)
    model.load_weights(checkpoint_on_grids(path))
    assert model.source_grids == {}
    model.pack_weights()
    assert not any(m.grid for m in model.modules() if isinstance(m, PackedLinear))


@needs_onednn_bf16
def test_a_bf16_model_keeps_the_codes_of_its_float32_checkpoint(tiny_model: Callable[..., Path],
                                                                 bf16_by_onednn: None) -> None:
    """A GGUF's weights reach the loader as float32 on their grids: a bf16 model finds the
    codes while loading (fused projections from their shards), serves small steps from them,
    and decodes with its blocks returned."""
    path = tiny_model("llama", tied=True)
    config = ModelConfig.from_dir(path)
    plain = model_class(config.architecture).create(config, torch.bfloat16, CPU)
    plain.load_weights(read_safetensors(path))
    assert plain.source_grids == {}
    model = model_class(config.architecture).create(config, torch.bfloat16, CPU)
    model.load_weights(checkpoint_on_grids(path))
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
            "model.embed_tokens.weight"} <= set(model.source_grids)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="bfloat16", num_kv_blocks=32, block_size=4),
                       LoadedModel(model, config, path))
    packed = engine.model_runner.model
    assert packed.source_grids == {}, "released once packed"
    layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert packed.lm_head.grid is not None and packed.lm_head.grid.format is GridFormat.Q8_0
    assert all(m.grid is not None and m.grid.format is GridFormat.Q4_1 for m in layers if m is not packed.lm_head)
    free = engine.num_free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("grid-bf16", [5, 17, 42, 7, 9], params)
    tokens: list[int] = []
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    assert len(tokens) == 12
    assert engine.num_free_blocks == free
