"""GGUF files, converted once into a Hugging Face folder that the loader reads fast.

transformers dequantises the GGUF tensors (to fp32) and rebuilds the
tokenizer from the file's metadata; that takes tens of seconds, so the result
is cached under a key made of the file's name, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def gguf_cache_key(gguf_path: Path) -> str:
    """Names the converted folder: a changed or replaced file gets a new one."""
    stat = gguf_path.stat()
    digest = hashlib.sha256(f"{gguf_path.name}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    return f"{gguf_path.stem}-{digest[:16]}"


def convert_gguf(gguf_path: Path, cache_root: Path) -> Path:
    """Returns a Hugging Face folder (safetensors, config, tokenizer) holding the
    GGUF model, converting it on the first call only."""
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    target = cache_root / gguf_cache_key(gguf_path)
    if (target / "config.json").is_file():
        return target
    # transformers is imported here only: the common case (cached folder) never needs it.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s into %s (one time)", gguf_path, target)
    cache_root.mkdir(parents=True, exist_ok=True)
    # NOTE: build in a private folder and rename it into place, so that a crash
    # or a concurrent conversion never leaves a half-written target.
    tmp = cache_root / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
        _save_dequantized(model, tmp)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # another process finished the same conversion first; its folder is as good
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_dequantized(model: Any, dest: Path) -> None:
    """Writes a transformers model loaded from GGUF as plain safetensors + config.

    NOTE: transformers marks GGUF-loaded models as quantized and refuses
    save_pretrained, although the weights are dequantized; so the tensors and
    the config (without its quantization entry) are written here.
    """
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    config["architectures"] = [type(model).__name__]  # save_pretrained would fill this in
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # the same tensor as the embedding
    not_float = [name for name, t in state.items() if t.dtype != torch.float32]
    if not_float:
        raise ValueError(f"GGUF conversion left non-fp32 (still quantized?) tensors: {not_float[:3]}")
    dest.mkdir(parents=True)
    save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=2, default=str))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(dest)
