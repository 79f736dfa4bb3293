"""Tiny random Hugging Face models (Llama, Qwen2, Qwen3, Gemma) for tests and benchmarks.

`build_tiny_model(family, dest)` writes a folder with config.json, safetensors
weights and a byte-level BPE tokenizer with a ChatML chat template, small
enough to build in seconds and to serve on a CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# NOTE: torch, tokenizers and transformers are imported inside the builders:
# the session conftest imports this module, and offline test runs must not
# pay for them.

FAMILIES = ("llama", "qwen2", "qwen3", "gemma")
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
    # one KV head (as Gemma 2B); Gemma's config class defaults head_dim to 256
    "gemma": dict(_COMMON, num_key_value_heads=1, head_dim=16, rope_theta=10000.0),
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
                     seed: int = 0, context: int | None = None, **config: Any) -> Path:
    """Writes a random model of `family` to `dest` as a Hugging Face folder;
    `context` replaces its 512 positions (prompts that this tokenizer makes long), `config`
    sets more of its config (`attention_bias=True`)."""
    import torch
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config, "gemma": transformers.GemmaConfig}[family]
    overrides = {**config, **({} if context is None else {"max_position_embeddings": context})}
    config = config_cls(**{**CONFIGS[family], **overrides}, tie_word_embeddings=tied)
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
