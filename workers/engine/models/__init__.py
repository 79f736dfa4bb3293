"""Model families, by the Hugging Face `architectures` name they serve."""

from __future__ import annotations

from typing import TypeAlias

from disagg.workers.engine.model_config import ARCHITECTURES, ModelConfigError
from disagg.workers.engine.models.llama import LlamaForCausalLM, WeightLoadError
from disagg.workers.engine.models.qwen2 import Qwen2ForCausalLM
from disagg.workers.engine.models.qwen3 import Qwen3ForCausalLM

# Every model class has the same interface as LlamaForCausalLM (create,
# load_weights, forward(batch, kv_cache), compute_logits).
CausalLM: TypeAlias = LlamaForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
assert MODEL_CLASSES.keys() == ARCHITECTURES.keys(), "model_config.ARCHITECTURES and MODEL_CLASSES must agree"


def model_class(architecture: str) -> type[CausalLM]:
    if architecture not in MODEL_CLASSES:
        raise ModelConfigError(f"unsupported architecture {architecture!r}: supported are {sorted(MODEL_CLASSES)}")
    return MODEL_CLASSES[architecture]


__all__ = ["MODEL_CLASSES", "CausalLM", "WeightLoadError", "model_class"]
