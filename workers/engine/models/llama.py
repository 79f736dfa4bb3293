"""The Llama family (Llama 2/3, SmolLM2, Mistral-style): the base the other families vary.

A family on this layout subclasses LlamaForCausalLM and swaps parts (LlamaParts)
or declares config traits; see qwen3.py and gemma.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from disagg.workers.engine.attention import (
    AttentionMetadata, build_metadata, decode_kernel, paged_attention, write_kv,
)
from disagg.workers.engine.forward_batch import ForwardBatch
from disagg.workers.engine.model_config import ConfigTraits, ModelConfig
from disagg.workers.engine.models import grids
from disagg.workers.engine.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rope, input_major
from disagg.workers.engine.models.packing import PackedLinear, codes_may_serve, pack_linear_weights
from disagg.workers.engine.models.registry import register


class WeightLoadError(ValueError):
    """A checkpoint whose tensors do not fit the model; the message names the tensor."""


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim ** -0.5
        # weight rows: [q (heads * hd) | k (kvh * hd) | v (kvh * hd)]
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)

    def normalize_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """Hook before RoPE on qk: [T, heads + kvh, hd]; the Llama family leaves it as it is."""
        return qk

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                layer_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; writes this layer's new K/V into layer_cache."""
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (heads + 2 kvh) * hd]
        # q and k side by side as heads, so that one RoPE call rotates both
        qk = qkv[:, :self.q_size + self.kv_size].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(self.normalize_qk(qk), cos, signed_sin).split([self.num_heads, self.num_kv_heads], dim=1)
        write_kv(layer_cache, k, v, meta)
        out = paged_attention(q, k, v, layer_cache, meta, self.scale)  # [T, heads, hd]
        return self.o_proj(out.reshape(tokens, self.q_size))


@dataclass(frozen=True)
class LlamaParts:
    """The modules a family on the Llama layout may swap for its own."""

    attention: type[LlamaAttention] = LlamaAttention
    norm: type[RMSNorm] = RMSNorm  # every RMSNorm of the decoder layers and the final one
    embedding: type[nn.Embedding] = nn.Embedding


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, parts: LlamaParts) -> None:
        super().__init__()
        self.input_layernorm = parts.norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = parts.attention(config)
        self.post_attention_layernorm = parts.norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                layer_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, signed_sin, layer_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, parts: LlamaParts) -> None:
        super().__init__()
        self.embed_tokens = parts.embedding(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            # It is also the output projection, whose matmul favours this layout;
            # the lookup of a few rows barely notices it.
            self.embed_tokens.weight = input_major(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, parts) for _ in range(config.num_layers))
        self.norm = parts.norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, on_layer_written: Callable[[int], None] | None) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [layers, blocks, 2, bs, kvh, hd] -> final hidden [T, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, signed_sin = self.rotary_emb(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, signed_sin, kv_cache[i], meta)
            if on_layer_written is not None:
                on_layer_written(i)
        return self.norm(x)


# Checkpoint projections that live as row ranges of one fused weight here:
# checkpoint name -> (our name, which range); see _shard_range.
_FUSED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}


@register("LlamaForCausalLM", "MistralForCausalLM")
class LlamaForCausalLM(nn.Module):
    traits: ClassVar[ConfigTraits] = ConfigTraits()
    parts: ClassVar[LlamaParts] = LlamaParts()

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.parts)
        # With tied embeddings the output projection is the embedding matrix itself
        # (until pack_weights gives it a packed copy).
        self.lm_head: nn.Module | None = None if config.tie_word_embeddings else \
            Linear(config.hidden_size, config.vocab_size, bias=False)
        self.source_grids: dict[str, grids.GridWeight] = {}  # load_weights to pack_weights (grids.SourceGrids)

    @classmethod
    def create(cls, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
        """An uninitialised model in `dtype` on `device`, ready for load_weights
        (built on the meta device, so no time goes into random init)."""
        with torch.device("meta"):
            model = cls(config)
        model = model.to(dtype=dtype).to_empty(device=device)
        model.model.rotary_emb.reset_inv_freq()
        return model.eval()

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Runs one step; returns the final hidden states [T, hidden] of every new token."""
        meta = build_metadata(batch, block_size=kv_cache.shape[3],
                              kernel=decode_kernel(kv_cache, self.config.num_heads))
        return self.model(batch.input_ids, batch.positions, kv_cache, meta, batch.on_layer_written)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (rows already picked, e.g. by logits_indices) -> fp32 logits [N, vocab]."""
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def pack_weights(self) -> None:
        """Move every projection to oneDNN's packed layout (CPU only; see packing.py).

        A tied output projection gets its own packed copy: the embedding lookup
        needs the plain rows. Nothing can be loaded into the model afterwards.
        """
        pack_linear_weights(self, self.source_grids)
        if self.lm_head is None:
            self.lm_head = PackedLinear(self.model.embed_tokens.weight, None,
                                        self.source_grids.get("model.embed_tokens.weight"))
        self.source_grids = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face named tensors into the model; raises WeightLoadError on
        unknown names, shape mismatches, or parameters left without a value."""
        params = dict(self.named_parameters())
        filled = dict.fromkeys(params, 0)  # elements written per parameter
        found = grids.SourceGrids()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue  # recomputed here / the tied embedding already holds it
            target_name, rows = self._target(name)
            if target_name not in params:
                raise WeightLoadError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
            target = params[target_name].data
            if rows is not None:
                target = target[rows[0]:rows[1]]
            if target.shape != tensor.shape:
                raise WeightLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                      f"expected {tuple(target.shape)}")
            target.copy_(tensor)
            filled[target_name] += tensor.numel()
            if tensor.dtype == torch.float32 != target.dtype and tensor.dim() == 2 and target.device.type == "cpu" \
                    and codes_may_serve(target.dtype):
                found.offer(target_name, 0 if rows is None else rows[0], tensor)
        missing = [n for n, p in params.items() if filled[n] != p.numel()]
        if missing:
            raise WeightLoadError(f"checkpoint lacks weights for {missing[:5]}"
                                  + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        self.source_grids = found.found({name: p.shape[0] for name, p in params.items()})

    def _target(self, name: str) -> tuple[str, tuple[int, int] | None]:
        """Checkpoint name -> (our parameter name, row range or None for the whole tensor)."""
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in _FUSED:
                fused, shard = _FUSED[part]
                parts[i] = fused
                return ".".join(parts), self._shard_range(shard)
        return name, None

    def _shard_range(self, shard: str) -> tuple[int, int]:
        c = self.config
        return {
            "q": (0, c.q_size),
            "k": (c.q_size, c.q_size + c.kv_size),
            "v": (c.q_size + c.kv_size, c.q_size + 2 * c.kv_size),
            "gate": (0, c.intermediate_size),
            "up": (c.intermediate_size, 2 * c.intermediate_size),
        }[shard]
