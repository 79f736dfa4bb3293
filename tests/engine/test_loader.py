"""Model sources: Hugging Face folders (single and sharded), errors, and the builtin GGUF model."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from disagg.workers.engine.loader import ModelLoadError, builtin_gguf_path, load_model
from disagg.workers.engine.model_config import ModelConfig, ModelConfigError
from disagg.workers.engine.models import WeightLoadError

torch.set_num_threads(2)
CPU = torch.device("cpu")


def copy_model(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in model_dir.glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


def test_config_fields(tiny_model: Callable[..., Path]) -> None:
    llama = ModelConfig.from_dir(tiny_model("llama"))
    assert (llama.architecture, llama.num_layers, llama.num_heads, llama.num_kv_heads) == \
        ("LlamaForCausalLM", 2, 4, 2)
    assert llama.head_dim == 16 and llama.eos_token_ids == (2,) and llama.bos_token_id == 0
    assert llama.rope_scaling is not None and llama.rope_scaling.rope_type == "llama3"
    assert not llama.attention_bias and llama.hidden_act == "silu"
    qwen2, qwen3 = ModelConfig.from_dir(tiny_model("qwen2")), ModelConfig.from_dir(tiny_model("qwen3"))
    assert qwen2.attention_bias and not qwen3.attention_bias
    assert not (qwen2.o_proj_bias or qwen3.o_proj_bias), "Qwen2's bias is on q, k and v only"
    assert qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_heads
    gemma = ModelConfig.from_dir(tiny_model("gemma"))
    assert (gemma.architecture, gemma.num_kv_heads, gemma.hidden_act) == ("GemmaForCausalLM", 1, "gelu_pytorch_tanh")
    assert len({llama.model_id, qwen2.model_id, qwen3.model_id, gemma.model_id}) == 4
    assert ModelConfig.from_dir(tiny_model("llama")).model_id == llama.model_id


def test_eos_ids_merge_generation_config(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model("qwen2"), tmp_path / "m")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert ModelConfig.from_dir(model_dir).eos_token_ids == (2, 0)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_tied_and_untied_embeddings(tiny_model: Callable[..., Path], family: str) -> None:
    tied = load_model(str(tiny_model(family, tied=True)), torch.float32, CPU)
    assert "lm_head.weight" not in checkpoint(tied.model_dir)
    assert tied.model.lm_head is None
    hidden = torch.randn(3, tied.config.hidden_size)
    torch.testing.assert_close(tied.model.compute_logits(hidden), hidden @ tied.model.model.embed_tokens.weight.T)

    untied = load_model(str(tiny_model(family)), torch.float32, CPU)
    weights = checkpoint(untied.model_dir)
    assert untied.model.lm_head is not None
    torch.testing.assert_close(untied.model.lm_head.weight, weights["lm_head.weight"])
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_fused_projections_hold_the_checkpoint_tensors(tiny_model: Callable[..., Path]) -> None:
    loaded = load_model(str(tiny_model("qwen2")), torch.float32, CPU)
    weights = checkpoint(loaded.model_dir)
    attn = loaded.model.model.layers[1].self_attn
    expected_w = torch.cat([weights[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    expected_b = torch.cat([weights[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
    torch.testing.assert_close(attn.qkv_proj.weight, expected_w, atol=0, rtol=0)
    torch.testing.assert_close(attn.qkv_proj.bias, expected_b, atol=0, rtol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_matmul_weights_are_stored_input_major(tiny_model: Callable[..., Path], tied: bool) -> None:
    model = load_model(str(tiny_model("llama", tied=tied)), torch.bfloat16, CPU).model
    output = model.model.embed_tokens if tied else model.lm_head
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj, output):
        assert linear is not None and linear.weight.t().is_contiguous(), "the fast CPU matmul layout was lost"


def test_sharded_safetensors_load_like_one_file(tiny_model: Callable[..., Path]) -> None:
    sharded_dir = tiny_model("qwen3", max_shard_size="50KB")
    assert len(list(sharded_dir.glob("*.safetensors"))) > 1
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    sharded = load_model(str(sharded_dir), torch.float32, CPU).model.state_dict()
    single = load_model(str(tiny_model("qwen3")), torch.float32, CPU).model.state_dict()
    assert sharded.keys() == single.keys()
    for name in single:
        torch.testing.assert_close(sharded[name], single[name], atol=0, rtol=0)


def test_bf16_load_casts_weights(tiny_model: Callable[..., Path]) -> None:
    loaded = load_model(str(tiny_model("llama")), torch.bfloat16, CPU)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_missing_source(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"), torch.float32, CPU)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="no config.json"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_missing_weights(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model("llama"), tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(str(model_dir), torch.float32, CPU)


def test_missing_shard(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model("qwen3", max_shard_size="50KB"), tmp_path / "m")
    next(model_dir.glob("model-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="are missing"):
        load_model(str(model_dir), torch.float32, CPU)


def test_checkpoint_missing_a_tensor(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model_dir = copy_model(tiny_model("llama"), tmp_path / "m")
    weights = checkpoint(model_dir)
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(WeightLoadError, match="gate_up_proj"):
        load_model(str(model_dir), torch.float32, CPU)


def test_checkpoint_wrong_shape(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model("llama"), tmp_path / "m")
    edit_config(model_dir, intermediate_size=96)
    with pytest.raises(WeightLoadError, match="shape"):
        load_model(str(model_dir), torch.float32, CPU)


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
    ({"architectures": None}, "architectures"),
    ({"hidden_size": None}, "hidden_size"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"max_position_embeddings": -1}, "max_model_len"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"sliding_window": 16}, "sliding_window"),
    ({"use_bidirectional_attention": True}, "bidirectional"),
])
def test_bad_config(tiny_model: Callable[..., Path], tmp_path: Path, changes: dict, message: str) -> None:
    model_dir = copy_model(tiny_model("llama"), tmp_path / "m")
    edit_config(model_dir, **changes)
    with pytest.raises(ModelConfigError, match=message):
        load_model(str(model_dir), torch.float32, CPU)


@pytest.mark.parametrize("family,changes,applies", [
    ("llama", {"sliding_window": 16}, True),  # Llama/Mistral: a window applies unless turned off
    ("llama", {"sliding_window": 16, "use_sliding_window": False}, False),
    ("llama", {"sliding_window": 512}, False),  # not shorter than the context: no window
    ("qwen2", {"sliding_window": 16}, False),  # Qwen's traits default use_sliding_window to false
    ("qwen3", {"sliding_window": 16, "use_sliding_window": True}, True),
])
def test_sliding_window_rule(tiny_model: Callable[..., Path], tmp_path: Path, family: str,
                             changes: dict, applies: bool) -> None:
    model_dir = copy_model(tiny_model(family), tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("use_sliding_window", None)  # what the family's traits default, not what transformers wrote
    (model_dir / "config.json").write_text(json.dumps(config | changes))
    if applies:
        with pytest.raises(ModelConfigError, match="sliding_window"):
            ModelConfig.from_dir(model_dir)
    else:
        assert ModelConfig.from_dir(model_dir).architecture == config["architectures"][0]


def test_registry_serves_each_architecture_with_its_class() -> None:
    from disagg.workers.engine.models import MODEL_CLASSES, model_class, register
    from disagg.workers.engine.models.gemma import GemmaForCausalLM
    from disagg.workers.engine.models.llama import LlamaForCausalLM
    from disagg.workers.engine.models.qwen3 import Qwen3Attention

    assert model_class("MistralForCausalLM") is model_class("LlamaForCausalLM") is LlamaForCausalLM
    assert model_class("GemmaForCausalLM") is GemmaForCausalLM
    assert model_class("Qwen3ForCausalLM").parts.attention is Qwen3Attention  # type: ignore[attr-defined]
    with pytest.raises(ModelConfigError, match="unsupported architecture 'GPT2LMHeadModel'"):
        model_class("GPT2LMHeadModel")
    with pytest.raises(AssertionError, match="served by GemmaForCausalLM already"):
        register("GemmaForCausalLM")(LlamaForCausalLM)
    assert MODEL_CLASSES["GemmaForCausalLM"] is GemmaForCausalLM


def test_config_not_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)


def test_unknown_builtin_and_non_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="unknown builtin model"):
        load_model("builtin:nope", torch.float32, CPU)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        load_model(str(tmp_path / "weights.bin"), torch.float32, CPU)


@pytest.mark.slow
def test_builtin_gguf_converts_once_and_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers
    from transformers import AutoTokenizer

    from disagg.workers.engine import gguf

    try:
        builtin_gguf_path("smollm2-135m")
    except ModelLoadError as e:
        pytest.skip(str(e))
    first = load_model("builtin:smollm2-135m", torch.float32, CPU, cache_dir=tmp_path)
    assert first.config.architecture == "LlamaForCausalLM" and first.config.num_layers == 30
    stamp = (first.model_dir / "config.json").stat().st_mtime_ns

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached folder should have been used")

    with monkeypatch.context() as patch:
        patch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
        second = load_model("builtin:smollm2-135m", torch.float32, CPU, cache_dir=tmp_path)
    assert second.model_dir == first.model_dir
    assert (second.model_dir / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [second.model_dir.name], "no temp folders left behind"
    assert gguf.gguf_cache_key(builtin_gguf_path("smollm2-135m")) == second.model_dir.name

    tokenizer = AutoTokenizer.from_pretrained(second.model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    answer = greedy_answer(second, tokenizer.encode(text), max_tokens=12)
    assert "Paris" in tokenizer.decode(answer)


@torch.no_grad()
def greedy_answer(loaded: object, ids: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding through a 1-sequence paged cache with contiguous blocks."""
    from disagg.workers.engine.forward_batch import ForwardBatch

    c = loaded.config  # type: ignore[attr-defined]
    model = loaded.model  # type: ignore[attr-defined]
    block_size, total = 16, len(ids) + max_tokens
    num_blocks = -(-total // block_size)
    kv = torch.zeros(c.num_layers, num_blocks, 2, block_size, c.num_kv_heads, c.head_dim)
    table = torch.arange(num_blocks, dtype=torch.int32)[None]
    out: list[int] = []
    new, start = ids, 0
    while len(out) < max_tokens:
        positions = torch.arange(start, start + len(new))
        batch = ForwardBatch(torch.tensor(new), positions, positions.clone(), [len(new)],
                             torch.tensor([start + len(new)], dtype=torch.int32), table,
                             torch.tensor([len(new) - 1]))
        token = int(model.compute_logits(model(batch, kv)[batch.logits_indices])[0].argmax())
        if token in c.eos_token_ids:
            break
        out.append(token)
        start, new = start + len(new), [token]
    return out
