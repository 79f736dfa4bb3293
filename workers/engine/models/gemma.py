"""Gemma (1): the Llama layout with (1 + w) RMSNorm, embeddings scaled by
sqrt(hidden), a GELU (tanh) MLP and, by default, a tied output projection."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from disagg.workers.engine.model_config import ConfigTraits
from disagg.workers.engine.models.layers import RMSNorm
from disagg.workers.engine.models.llama import LlamaForCausalLM, LlamaParts
from disagg.workers.engine.models.registry import register


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight): checkpoints store the scale minus one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32 and rounded once at the end, as the reference does (Llama's norm
        # rounds before the scale), so bf16 runs round as Gemma's do.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """Rows multiplied by sqrt(embedding_dim)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(input_ids)
        # NOTE: the reference rounds the scale to the weights' dtype first
        # (sqrt(3072) is 55.5 in bf16); a scalar of that value multiplies the same.
        return rows * torch.tensor(self.embedding_dim ** 0.5, dtype=rows.dtype).item()


@register("GemmaForCausalLM")
class GemmaForCausalLM(LlamaForCausalLM):
    # Gemma's reference defaults these when config.json leaves them out (the
    # released checkpoints do), and reads the legacy "gelu" as the tanh GELU.
    traits: ClassVar[ConfigTraits] = ConfigTraits(
        defaults={"tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"},
        hidden_act_aliases={"gelu": "gelu_pytorch_tanh"})
    parts: ClassVar[LlamaParts] = LlamaParts(norm=GemmaRMSNorm, embedding=ScaledEmbedding)
