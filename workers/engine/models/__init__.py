"""Model families, by the Hugging Face `architectures` names they serve (see registry.py).

Adding a family: a new module whose class carries @register, and its import here.
"""

from __future__ import annotations

from disagg.workers.engine.models import gemma, llama, qwen2, qwen3  # noqa: F401 (each registers its family)
from disagg.workers.engine.models.llama import WeightLoadError
from disagg.workers.engine.models.registry import MODEL_CLASSES, CausalLM, model_class, register

__all__ = ["MODEL_CLASSES", "CausalLM", "WeightLoadError", "model_class", "register"]
