"""Tiny random Hugging Face models (Llama, Qwen2, Qwen3) and a hand-driven paged cache.

Fixtures for every engine test:
- `tiny_model(family, tied=False, max_shard_size=None) -> Path`: a folder with
  config.json, safetensors weights and a byte-level BPE tokenizer with a ChatML
  chat template, built once per session per argument set.
- `tiny_model_dir`: the same, parametrized over the three families (untied).
- `paged_cache`: the PagedCache class, which builds ForwardBatch objects by
  hand, the way the engine's model runner does.
- `builtin_model_dir`: the embedded default model's folder (session; slow the first time).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from disagg.workers.engine.forward_batch import ForwardBatch

FAMILIES = ("llama", "qwen2", "qwen3")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
VOCAB_SIZE = 320  # tokenizer: 3 specials + 256 bytes + merges; the model's vocab matches
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Prefill and decode run on different machines; the KV cache moves between them.",
    "Hello world! How are you today? I am fine, thank you.",
    "0123456789 + - * / = ( ) [ ] { } < > héllo wörld 你好",
]

_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=VOCAB_SIZE, max_position_embeddings=512,
    bos_token_id=0, eos_token_id=2, rms_norm_eps=1e-6,
)
CONFIGS: dict[str, dict[str, Any]] = {
    # llama3 scaling with a short original context, so that all three bands
    # (kept, blended, stretched) occur among the 8 frequencies of head_dim 16.
    "llama": dict(_COMMON, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=10000.0),
    "qwen2": dict(_COMMON, rope_theta=1000000.0),
    # explicit head_dim 32 != hidden_size / heads = 16
    "qwen3": dict(_COMMON, head_dim=32, rope_theta=1000000.0),
}


def build_tokenizer(dest: Path) -> None:
    """Saves a small byte-level BPE tokenizer (any text encodes) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE, "tokenizer vocab must fit the model's"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(dest)


def build_tiny_model(family: str, dest: Path, *, tied: bool = False, max_shard_size: str | None = None,
                     seed: int = 0) -> Path:
    """Writes a random model of `family` to `dest` as a Hugging Face folder."""
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config}[family]
    config = config_cls(**CONFIGS[family], tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Default init leaves biases at 0 and norms at 1, which would hide a wrong
    # mapping of those tensors; give every tensor distinct values.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(dest, **kwargs)
    build_tokenizer(dest)
    return dest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple[str, bool, str | None], Path] = {}

    def get(family: str, tied: bool = False, max_shard_size: str | None = None) -> Path:
        key = (family, tied, max_shard_size)
        if key not in cache:
            dest = tmp_path_factory.mktemp(f"tiny-{family}-{'tied' if tied else 'untied'}")
            cache[key] = build_tiny_model(family, dest, tied=tied, max_shard_size=max_shard_size)
        return cache[key]

    return get


@pytest.fixture(params=FAMILIES)
def tiny_model_dir(request: pytest.FixtureRequest, tiny_model: Callable[..., Path]) -> Path:
    return tiny_model(request.param)


class PagedCache:
    """A KV cache tensor plus per-sequence block tables, driven by hand.

    Physical block ids are handed out in a shuffled order, so that a test
    passes only if every read and write goes through the block tables.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, block_size: int,
                 num_blocks: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 seed: int = 0) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        # [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim,
                                    dtype=dtype, device=self.device)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # tokens in the cache per sequence

    def _slot(self, seq: int, position: int) -> int:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size <= position:
            table.append(self.free.pop())
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def share_prefix(self, source: int, dest: int, num_blocks: int) -> None:
        """Starts `dest` with the first full blocks of `source`, as a prefix-cache hit does."""
        assert self.lengths[source] >= num_blocks * self.block_size, "only full blocks can be shared"
        self.tables[dest] = self.tables[source][:num_blocks]
        self.lengths[dest] = num_blocks * self.block_size

    def batch(self, chunks: dict[int, list[int]]) -> ForwardBatch:
        """One step that appends chunks[seq] (token ids) to each sequence; logits for every token."""
        ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        for seq, tokens in chunks.items():
            start = self.lengths.get(seq, 0)
            for i, token in enumerate(tokens):
                ids.append(token)
                positions.append(start + i)
                slots.append(self._slot(seq, start + i))
            self.lengths[seq] = start + len(tokens)
            query_lens.append(len(tokens))
            context_lens.append(self.lengths[seq])
        width = max(len(self.tables[s]) for s in chunks)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in chunks]
        on = {"device": self.device}
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, **on),
            positions=torch.tensor(positions, dtype=torch.int64, **on),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, **on),
            query_lens=query_lens,
            context_lens=torch.tensor(context_lens, dtype=torch.int32, **on),
            block_tables=torch.tensor(tables, dtype=torch.int32, **on),
            logits_indices=torch.arange(len(ids), dtype=torch.int64, **on),
        )


@pytest.fixture
def paged_cache() -> type[PagedCache]:
    return PagedCache


@pytest.fixture(scope="session")
def builtin_model_dir() -> Path:
    """The embedded default (SmolLM2-135M-Instruct) as a Hugging Face folder, converted
    into the user cache on first use (about a minute); skips when the package is missing."""
    from disagg.workers.engine.loader import ModelLoadError, default_cache_dir, resolve_model_dir

    try:
        return resolve_model_dir("builtin:smollm2-135m", default_cache_dir())
    except ModelLoadError as e:
        pytest.skip(str(e))
