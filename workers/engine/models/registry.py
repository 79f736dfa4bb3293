"""The model families: one registry, filled by a decorator on each family's class.

A family is a class that serves some config.json `architectures` names, has the
CausalLM interface, and declares the ConfigTraits that reading its config.json
needs. Most families extend LlamaForCausalLM and swap a few of its parts; one
that does not only has to satisfy CausalLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

import torch

from disagg.workers.engine.model_config import ConfigTraits, ModelConfigError

if TYPE_CHECKING:
    from disagg.workers.engine.forward_batch import ForwardBatch
    from disagg.workers.engine.model_config import ModelConfig


class CausalLM(Protocol):
    """A model family's class, as the loader and the model runner use it."""

    traits: ClassVar[ConfigTraits]  # what ModelConfig.from_dict must know to read this family's config.json

    @classmethod
    def create(cls, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
        """An uninitialised model in `dtype` on `device`; every parameter gets its
        value from load_weights (so no time goes into random init)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face named tensors into the model.

        Raises WeightLoadError on an unknown name, a shape mismatch, or a
        parameter left without a value.
        """
        ...

    def __call__(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Runs one step (as forward); the model runner calls the module itself."""
        ...

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Runs one step over the batch's new tokens.

        Args: kv_cache: [layers, blocks, 2, block_size, kv_heads, head_dim]; each
        new token's K/V is written at its slot, and `batch.on_layer_written(i)`
        (if set) is called once layer i's K/V are in the cache.
        Returns: the final hidden states [T, hidden] of every new token.
        """
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (rows already picked) -> fp32 logits [N, vocab]."""
        ...

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """Its weights (a family is a torch.nn.Module)."""
        ...

    def pack_weights(self) -> None:
        """Moves the projections to oneDNN's packed layout (CPU only; see packing.py).
        Nothing can be loaded into the model afterwards."""
        ...


_Family = TypeVar("_Family", bound=CausalLM)
_CLASSES: dict[str, type[CausalLM]] = {}
# config.json `architectures` name -> the family's class (read-only; register() fills it)
MODEL_CLASSES: Mapping[str, type[CausalLM]] = MappingProxyType(_CLASSES)


def register(*architectures: str) -> Callable[[type[_Family]], type[_Family]]:
    """Class decorator: the class serves config.json files whose `architectures`
    list names one of `architectures`."""

    def add(cls: type[_Family]) -> type[_Family]:
        for name in architectures:
            assert name not in _CLASSES, f"{name} is served by {_CLASSES[name].__name__} already"
            _CLASSES[name] = cls
        return cls

    return add


def model_class(architecture: str) -> type[CausalLM]:
    if architecture not in _CLASSES:
        raise ModelConfigError(f"unsupported architecture {architecture!r}: supported are {sorted(_CLASSES)}")
    return _CLASSES[architecture]
