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

    def normalize_qk(self, qk: torch.Tensor) -> torch.Tensor:
        # qk: [T, heads + kvh, hd]; each head is normalised over hd, q and k with their own weights
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
