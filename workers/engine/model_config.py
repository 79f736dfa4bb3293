"""The model's shape and numerics, read from a Hugging Face `config.json`."""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


class ModelConfigError(ValueError):
    """A config.json that the engine cannot serve; the message names the field."""


@dataclass(frozen=True)
class ConfigTraits:
    """What reading a family's config.json must know beyond the file: each model
    class declares its own (models/registry.py), next to the modules it builds."""

    qkv_bias: bool = False  # q/k/v projections always carry a bias (Qwen2), whatever the file says
    # Fields the family's Hugging Face config class defaults, where they differ from Llama's:
    # a config.json may leave them out (Qwen: use_sliding_window false; Gemma: a tied head).
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # hidden_act names the family's reference reads as another (Gemma: "gelu" is the tanh GELU)
    hidden_act_aliases: Mapping[str, str] = field(default_factory=dict)


# hidden_act -> the MLP's activation, as transformers' ACT2FN computes it
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `linear` divides every frequency by `factor`;
    `llama3` divides only the low frequencies and blends the middle band."""

    rope_type: str  # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    attention_bias: bool  # q, k and v carry a bias
    o_proj_bias: bool  # the attention's output projection does too (config.json's attention_bias, not Qwen2's trait)
    mlp_bias: bool
    hidden_act: str  # a key of ACTIVATIONS
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: torch.dtype  # the checkpoint's dtype; the engine may run in another

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "vocab_size", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"config field {name!r} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ModelConfigError("rms_norm_eps and rope_theta must be positive")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def model_id(self) -> str:
        """Identity of the model's shape and numerics, equal on every pod that loaded
        the same config: the KV layout handshake compares it."""
        fields = {k: v for k, v in asdict(self).items() if k != "dtype"}
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
        return f"{self.architecture}-{self.num_layers}x{self.hidden_size}-{digest[:12]}"

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        """Reads `config.json` (required) and `generation_config.json` (optional, for EOS ids)."""
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise ModelConfigError(f"{model_dir} has no config.json")
        try:
            hf = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{config_path} is not valid JSON: {e}") from e
        gen_path = model_dir / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_dict(hf, generation)

    @classmethod
    def from_dict(cls, hf: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        if not isinstance(hf, dict):
            raise ModelConfigError("config.json must hold a JSON object")
        architecture, traits = _family(hf)
        hf = {**traits.defaults, **hf}
        hidden_act = hf.get("hidden_act", "silu")
        hidden_act = traits.hidden_act_aliases.get(hidden_act, hidden_act)
        if hidden_act not in ACTIVATIONS:
            raise ModelConfigError(f"hidden_act {hidden_act!r} is not supported (one of {sorted(ACTIVATIONS)})")
        if hf.get("use_bidirectional_attention"):
            raise ModelConfigError("use_bidirectional_attention is not supported (only causal attention)")
        _reject_sliding_window(hf)
        num_heads = _required(hf, "num_attention_heads")
        hidden_size = _required(hf, "hidden_size")
        head_dim = hf.get("head_dim")
        if head_dim is None:
            if not (isinstance(hidden_size, int) and isinstance(num_heads, int) and num_heads > 0) \
                    or hidden_size % num_heads:
                raise ModelConfigError(
                    f"hidden_size ({hidden_size}) must be a multiple of num_attention_heads ({num_heads}) "
                    "when head_dim is not given")
            head_dim = hidden_size // num_heads
        rope_theta, rope_scaling = _rope(hf)
        dtype_name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        if dtype_name not in _DTYPES:
            raise ModelConfigError(f"dtype {dtype_name!r} is not one of {sorted(_DTYPES)}")
        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            intermediate_size=_required(hf, "intermediate_size"),
            num_layers=_required(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            vocab_size=_required(hf, "vocab_size"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=traits.qkv_bias or bool(hf.get("attention_bias", False)),
            o_proj_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=hidden_act,
            max_model_len=_required(hf, "max_position_embeddings"),
            eos_token_ids=_token_ids(hf.get("eos_token_id"), (generation or {}).get("eos_token_id")),
            bos_token_id=hf.get("bos_token_id"),
            dtype=_DTYPES[dtype_name],
        )


def _family(hf: dict[str, Any]) -> tuple[str, ConfigTraits]:
    """The first of config.json's `architectures` that a model family serves, and its traits."""
    # NOTE: imported here: the model classes, which import this module, declare the traits.
    from disagg.workers.engine.models import MODEL_CLASSES

    architectures = hf.get("architectures")
    if not architectures or not isinstance(architectures, list):
        raise ModelConfigError("config.json has no 'architectures' list")
    for name in architectures:
        if name in MODEL_CLASSES:
            return str(name), MODEL_CLASSES[name].traits
    raise ModelConfigError(
        f"unsupported architecture {architectures}: supported are {sorted(MODEL_CLASSES)}")


def _required(hf: dict[str, Any], name: str) -> Any:
    if name not in hf or hf[name] is None:
        raise ModelConfigError(f"config.json is missing the field {name!r}")
    return hf[name]


def _reject_sliding_window(hf: dict[str, Any]) -> None:
    # A window applies unless `use_sliding_window` turns it off (families whose
    # reference defaults that flag to false say so in their traits), and only
    # when it is shorter than the context.
    window = hf.get("sliding_window")
    applies = hf.get("use_sliding_window", True)
    if window is not None and applies and window < hf.get("max_position_embeddings", math.inf):
        raise ModelConfigError(f"sliding_window attention ({window}) is not supported")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ModelConfigError(f"layer_types {sorted(layer_types)} are not supported (only full_attention)")


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 4.x writes `rope_theta` + `rope_scaling`; 5.x folds both into `rope_parameters`.
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise ModelConfigError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3)")
    if "factor" not in scaling:
        raise ModelConfigError(f"rope_scaling of type {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    try:
        return theta, RopeScaling(
            "llama3",
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelConfigError(f"rope_scaling of type 'llama3' is missing {e.args[0]!r}") from e


def _token_ids(*values: Any) -> tuple[int, ...]:
    """Union of int-or-list token id fields, in first-seen order."""
    ids: list[int] = []
    for value in values:
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return tuple(ids)
