"""Our models through the paged cache against Hugging Face transformers, in fp32."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from disagg.testing.tiny_model import build_tiny_model
from disagg.workers.engine.forward_batch import ForwardBatch
from disagg.workers.engine.loader import LoadedModel, load_model
from disagg.workers.engine.models.packing import packing_available

torch.set_num_threads(2)
ATOL = 1e-4
FAMILIES = ("llama", "qwen2", "qwen3", "gemma")
CPU = torch.device("cpu")
# Our projections from plain weights, and from oneDNN-packed ones (what LLMEngine runs on a CPU).
WEIGHTS = ("strided", pytest.param("packed", marks=pytest.mark.skipif(
    not packing_available(CPU, torch.float32), reason="this torch has no oneDNN linear")))


@pytest.fixture(scope="module")
def models(tiny_model: Callable[..., Path]) -> Callable[..., tuple[LoadedModel, torch.nn.Module]]:
    """(family, weights) -> (our model, the transformers model) from the same folder, loaded once."""
    from transformers import AutoModelForCausalLM

    loaded: dict[tuple[str, str], tuple[LoadedModel, torch.nn.Module]] = {}

    def get(family: str, weights: str = "strided") -> tuple[LoadedModel, torch.nn.Module]:
        if (family, weights) not in loaded:
            path = tiny_model(family)
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            ours = load_model(str(path), torch.float32, CPU)
            if weights == "packed":
                ours.model.pack_weights()
            loaded[family, weights] = (ours, reference)
        return loaded[family, weights]

    return get


def new_cache(paged_cache: type, ours: LoadedModel, block_size: int, seed: int = 0) -> object:
    c = ours.config
    return paged_cache(c.num_layers, c.num_kv_heads, c.head_dim, block_size=block_size, num_blocks=64, seed=seed)


@torch.no_grad()
def step(ours: LoadedModel, cache: object, chunks: dict[int, list[int]]) -> torch.Tensor:
    """Runs one ForwardBatch; returns fp32 logits for every new token [T, vocab]."""
    batch: ForwardBatch = cache.batch(chunks)  # type: ignore[attr-defined]
    hidden = ours.model(batch, cache.kv_cache)  # type: ignore[attr-defined]
    return ours.model.compute_logits(hidden[batch.logits_indices])


@torch.no_grad()
def reference_logits(reference: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return reference(torch.tensor([ids])).logits[0].float()  # [len, vocab]


def prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(length)]


def generate(ours: LoadedModel, cache: object, seq: int, chunks: list[list[int]],
             steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefills `chunks` one step each, then decodes greedily; returns (generated ids, logits of
    every position [prompt + steps - 1, vocab])."""
    logits = [step(ours, cache, {seq: chunk}) for chunk in chunks]
    tokens = [int(logits[-1][-1].argmax())]
    for _ in range(steps - 1):
        logits.append(step(ours, cache, {seq: [tokens[-1]]}))
        tokens.append(int(logits[-1][-1].argmax()))
    return tokens, torch.cat(logits)


def assert_matches_reference(reference: torch.nn.Module, prompt_ids: list[int], tokens: list[int],
                             logits: torch.Tensor) -> None:
    expected = reference_logits(reference, prompt_ids + tokens[:-1])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    # greedy tokens equal: the reference's argmax after each prefix is our next token
    assert expected[len(prompt_ids) - 1:].argmax(-1).tolist() == tokens


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size,prompt_len", [
    (1, 5), (2, 1), (2, 3), (2, 4), (16, 15), (16, 16), (16, 17), (16, 33),
])
def test_prefill_then_decode_matches_transformers(models: Callable, paged_cache: type, family: str,
                                                  block_size: int, prompt_len: int, weights: str) -> None:
    ours, reference = models(family, weights)
    cache = new_cache(paged_cache, ours, block_size, seed=prompt_len)
    ids = prompt(prompt_len, seed=prompt_len)
    tokens, logits = generate(ours, cache, 0, [ids], steps=6)
    assert_matches_reference(reference, ids, tokens, logits)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_attention_bias_matches_transformers(tmp_path: Path, paged_cache: type, family: str, weights: str) -> None:
    """`attention_bias: true` puts a bias on q, k, v and the output projection (transformers'
    Llama and Qwen3); such checkpoints did not load."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(family, tmp_path, attention_bias=True)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(str(path), torch.float32, CPU)
    if weights == "packed":
        ours.model.pack_weights()
    ids = prompt(17)
    tokens, logits = generate(ours, new_cache(paged_cache, ours, 16), 0, [ids], steps=6)
    assert_matches_reference(reference, ids, tokens, logits)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("split", [[7, 6, 7], [10, 10], [19, 1]])
def test_chunked_prefill_matches_transformers(models: Callable, paged_cache: type, family: str,
                                              split: list[int]) -> None:
    ours, reference = models(family)
    ids = prompt(sum(split), seed=1)
    bounds = [sum(split[:i]) for i in range(len(split) + 1)]
    chunks = [ids[a:b] for a, b in zip(bounds, bounds[1:])]
    tokens, logits = generate(ours, new_cache(paged_cache, ours, block_size=4), 0, chunks, steps=4)
    assert_matches_reference(reference, ids, tokens, logits)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_mixed_lengths_equals_each_alone(models: Callable, paged_cache: type, family: str,
                                                  weights: str) -> None:
    ours, reference = models(family, weights)
    prompts = {0: prompt(5, seed=10), 1: prompt(11, seed=11), 2: prompt(17, seed=12)}
    alone = {seq: generate(ours, new_cache(paged_cache, ours, 4), seq, [p], steps=5) for seq, p in prompts.items()}

    cache = new_cache(paged_cache, ours, 4, seed=99)
    # step 1 prefills sequences 0 and 1 together; sequence 2 joins in step 3 while
    # the others decode (a mixed step), then all three decode as one batch.
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    logits: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    pending = {0: prompts[0], 1: prompts[1]}
    for step_index in range(7):
        if step_index == 2:
            pending[2] = prompts[2]
        out = step(ours, cache, pending)
        offset = 0
        for seq, chunk in pending.items():
            rows = out[offset:offset + len(chunk)]
            offset += len(chunk)
            logits[seq].append(rows)
            tokens[seq].append(int(rows[-1].argmax()))
        pending = {seq: [tokens[seq][-1]] for seq in pending if len(tokens[seq]) < 5}

    for seq, (alone_tokens, alone_logits) in alone.items():
        assert tokens[seq] == alone_tokens, f"sequence {seq} differs when batched"
        torch.testing.assert_close(torch.cat(logits[seq]), alone_logits, atol=1e-5, rtol=0)
        assert_matches_reference(reference, prompts[seq], alone_tokens, alone_logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hit_matches_transformers(models: Callable, paged_cache: type, family: str) -> None:
    ours, reference = models(family)
    cache = new_cache(paged_cache, ours, block_size=4)
    shared = prompt(8, seed=5)
    step(ours, cache, {0: shared + prompt(3, seed=6)})
    # sequence 1 reuses sequence 0's two full blocks and computes only its own suffix
    cache.share_prefix(0, 1, num_blocks=2)
    suffix = prompt(6, seed=7)
    tokens, logits = generate(ours, cache, 1, [suffix], steps=4)
    expected = reference_logits(reference, shared + suffix + tokens[:-1])[len(shared):]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    assert expected[len(suffix) - 1:].argmax(-1).tolist() == tokens


@pytest.mark.parametrize("weights", WEIGHTS)
def test_gemma_as_released_matches_transformers(tiny_model: Callable[..., Path], paged_cache: type,
                                                tmp_path: Path, weights: str) -> None:
    """A config.json as Gemma's checkpoints ship it: no tie_word_embeddings (tied by
    default), the legacy hidden_act "gelu" (read as the tanh GELU)."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    model_dir = shutil.copytree(tiny_model("gemma", tied=True), tmp_path / "gemma")
    config = json.loads((model_dir / "config.json").read_text())
    del config["tie_word_embeddings"]
    (model_dir / "config.json").write_text(json.dumps(config | {"hidden_act": "gelu"}))
    ours = load_model(str(model_dir), torch.float32, CPU)
    assert ours.config.tie_word_embeddings and ours.config.hidden_act == "gelu_pytorch_tanh"
    if weights == "packed":
        ours.model.pack_weights()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = prompt(13, seed=8)
    tokens, logits = generate(ours, new_cache(paged_cache, ours, block_size=4), 0, [ids[:6], ids[6:]], steps=5)
    assert_matches_reference(reference, ids, tokens, logits)


def test_on_layer_written_sees_each_layer_in_the_cache(models: Callable, paged_cache: type) -> None:
    ours, _ = models("llama")
    cache = new_cache(paged_cache, ours, block_size=2)
    batch = cache.batch({0: prompt(5)})
    kv = cache.kv_cache
    written = batch.slot_mapping
    calls: list[tuple[int, bool, bool]] = []

    def on_layer_written(layer: int) -> None:
        rows = kv[layer].transpose(0, 1).reshape(2, -1, *kv.shape[-2:])  # [2, slots, kvh, hd]
        later_rows = kv[layer + 1:].abs().sum()
        calls.append((layer, bool(rows[:, written].abs().amin(dim=(-1, -2)).gt(0).all()), bool(later_rows == 0)))

    batch.on_layer_written = on_layer_written
    with torch.no_grad():
        ours.model(batch, kv)
    # once per layer, in order; this layer's K and V are written, later layers not yet
    assert calls == [(i, True, True) for i in range(ours.config.num_layers)]


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_follows_fp32(tiny_model: Callable[..., Path], models: Callable, paged_cache: type,
                           family: str) -> None:
    ours, _ = models(family)
    half = load_model(str(tiny_model(family)), torch.bfloat16, CPU)
    ids = prompt(9, seed=3)
    c = half.config
    cache = paged_cache(c.num_layers, c.num_kv_heads, c.head_dim, block_size=4, num_blocks=16, dtype=torch.bfloat16)
    fp32_cache = new_cache(paged_cache, ours, 4)
    got = step(half, cache, {0: ids})
    expected = step(ours, fp32_cache, {0: ids})
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0.05)
    # a decode step: on a CPU, bf16's paged decode kernel and elementwise kernels
    next_token = [int(expected[-1].argmax())]
    torch.testing.assert_close(step(half, cache, {0: next_token}), step(ours, fp32_cache, {0: next_token}),
                               atol=0.1, rtol=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_follows_cpu_fp32(tiny_model: Callable[..., Path], models: Callable, paged_cache: type,
                               family: str, dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ours, _ = models(family)
    gpu = load_model(str(tiny_model(family)), dtype, torch.device("cuda"))
    c = gpu.config
    ids = prompt(21, seed=4)
    chunks = [ids[:12], ids[12:]]  # a fresh prefill, then a chunk over a cached prefix
    cache = paged_cache(c.num_layers, c.num_kv_heads, c.head_dim, block_size=4, num_blocks=32,
                        dtype=dtype, device="cuda")
    got = torch.cat([step(gpu, cache, {0: chunk}) for chunk in chunks])
    expected = step(ours, new_cache(paged_cache, ours, 4), {0: ids})
    tol = 1e-3 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.cpu(), expected, atol=tol, rtol=0.05)
    # batched decode on the device, against the CPU's
    cpu_cache = new_cache(paged_cache, ours, 4)
    step(ours, cpu_cache, {0: ids})
    next_token = [int(expected[-1].argmax())]
    torch.testing.assert_close(step(gpu, cache, {0: next_token}).cpu(),
                               step(ours, cpu_cache, {0: next_token}), atol=tol, rtol=0.05)
