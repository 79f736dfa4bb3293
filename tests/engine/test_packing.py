"""Packed projections (panels or oneDNN): the same matmuls as the plain weights, and what LLMEngine runs on a CPU."""

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
from disagg.workers.engine.models.packing import PackedLinear, pack_linear_weights, packing_available

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not packing_available(CPU, torch.float32), reason="this torch has no oneDNN linear")


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), pytest.param(torch.bfloat16, 2e-2, marks=pytest.mark.skipif(
    not packing_available(CPU, torch.bfloat16), reason="oneDNN has no bf16 linear on this CPU"))])
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(dtype: torch.dtype, atol: float, rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(48, 40).to(dtype)
    b = torch.randn(48).to(dtype) if bias else None
    x = torch.randn(rows, 40).to(dtype)
    got = PackedLinear(weight, b)(x)
    assert got.shape == (rows, 48) and got.dtype == dtype
    torch.testing.assert_close(got.float(), F.linear(x, weight, b).float(), atol=atol, rtol=1e-3)


def test_packing_replaces_every_linear_and_keeps_the_logits(tiny_model: Callable[..., Path]) -> None:
    loaded = load_model(str(tiny_model("qwen2", tied=True)), torch.float32, CPU)  # q/k/v bias, tied head
    model = loaded.model
    ids = torch.tensor([[5, 17, 42, 7]])
    hidden = torch.randn(3, loaded.config.hidden_size)
    with torch.no_grad():
        before = model.compute_logits(hidden)
        qkv = model.model.layers[0].self_attn.qkv_proj
        qkv_before = qkv(hidden)

    model.pack_weights()
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)  # the tied head got its own packed copy
    assert model.model.embed_tokens(ids).shape == (1, 4, loaded.config.hidden_size)  # lookups still work
    with torch.no_grad():
        torch.testing.assert_close(model.compute_logits(hidden), before, atol=1e-5, rtol=0)
        torch.testing.assert_close(model.model.layers[0].self_attn.qkv_proj(hidden), qkv_before, atol=1e-5, rtol=0)
    assert pack_linear_weights(model) == 0  # packing twice changes nothing


@pytest.mark.parametrize("pack", [True, False])
def test_engine_packs_cpu_weights_unless_told_not_to(tiny_model: Callable[..., Path], pack: bool) -> None:
    path = str(tiny_model("llama"))
    config = EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=8, pack_cpu_weights=pack)
    engine = LLMEngine(config, load_model(path, torch.float32, CPU))
    packed = [m for m in engine.model_runner.model.modules() if isinstance(m, PackedLinear)]
    # per layer qkv, o, gate_up, down; plus the untied head
    assert len(packed) == (4 * engine.model_config.num_layers + 1 if pack else 0)


def test_an_engine_refuses_a_model_loaded_in_another_dtype(tiny_model: Callable[..., Path]) -> None:
    path = str(tiny_model("llama"))
    with pytest.raises(ValueError, match=r"loaded in torch.float32, the engine runs torch.bfloat16"):
        LLMEngine(EngineConfig(model=path, device="cpu", dtype="bfloat16", num_kv_blocks=8),
                  load_model(path, torch.float32, CPU))


def test_packing_is_cpu_only() -> None:
    assert not packing_available(torch.device("cuda"), torch.bfloat16)
    assert not packing_available(CPU, torch.float16)
