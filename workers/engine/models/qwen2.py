"""Qwen2 / Qwen2.5: the Llama layout with biased q/k/v projections."""

from __future__ import annotations

from typing import ClassVar

from disagg.workers.engine.model_config import ConfigTraits
from disagg.workers.engine.models.llama import LlamaForCausalLM
from disagg.workers.engine.models.registry import register

# Qwen configs carry a `sliding_window` that applies only with `use_sliding_window`,
# which their reference defaults to false.
QWEN_DEFAULTS = {"use_sliding_window": False}


@register("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama's modules: the traits give the fused qkv projection its bias
    (config.attention_bias), which Qwen2's config.json does not state."""

    traits: ClassVar[ConfigTraits] = ConfigTraits(qkv_bias=True, defaults=QWEN_DEFAULTS)
