"""Qwen2 / Qwen2.5: the Llama layout with biased q/k/v projections."""

from __future__ import annotations

from disagg.workers.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same modules as Llama: ModelConfig sets `attention_bias` for this
    architecture, which gives the fused qkv projection its bias."""
