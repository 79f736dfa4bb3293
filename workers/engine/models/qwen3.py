"""Qwen3: the Llama layout with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

import torch

from disagg.workers.engine.model_config import ModelConfig
from disagg.workers.engine.models.layers import RMSNorm
from disagg.workers.engine.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, heads, hd], k: [T, kvh, hd]; each head is normalised over hd
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
