"""Qwen3: the Llama layout with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from typing import ClassVar

import torch

from disagg.workers.engine.model_config import ConfigTraits, ModelConfig
from disagg.workers.engine.models.layers import RMSNorm
from disagg.workers.engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaParts
from disagg.workers.engine.models.qwen2 import QWEN_DEFAULTS
from disagg.workers.engine.models.registry import register


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def normalize_qk(self, qk: torch.Tensor) -> torch.Tensor:
        # qk: [T, heads + kvh, hd]; each head is normalised over hd, q and k with their own weights
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)


@register("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    traits: ClassVar[ConfigTraits] = ConfigTraits(defaults=QWEN_DEFAULTS)
    parts: ClassVar[LlamaParts] = LlamaParts(attention=Qwen3Attention)
