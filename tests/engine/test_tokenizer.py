"""The tokenizer wrapper and the incremental detokenizer, on a real byte-level
BPE tokenizer small enough that most non-ASCII characters span several tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg.workers.engine.tokenizer import FALLBACK_CHAT_TEMPLATE, Tokenizer

CORPUS = ["hello world", "the quick brown fox", "hello there, world", "jumps over the lazy dog"]
MULTIBYTE = "héllo wörld 中文 🙂👍🏽 ok"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _save_tokenizer(path: Path, chat_template: str | None) -> Path:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(_save_tokenizer(tmp_path_factory.mktemp("tok"), None))


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = _save_tokenizer(tmp_path_factory.mktemp("chat_tok"), CHAT_TEMPLATE)
    # An instruct model that also stops on a second id, named only in its generation config.
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    return Tokenizer.from_dir(path)


def test_multibyte_characters_span_several_tokens(tokenizer: Tokenizer) -> None:
    # Guards the premise of the UTF-8 tests below.
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    assert "\ufffd" in tokenizer.decode(ids[:1])


def test_deltas_never_break_utf8_and_add_up_to_the_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    detok = tokenizer.detokenizer()
    deltas = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == MULTIBYTE == detok.text
    assert detok.flush() == ""
    # Text was held back at least once: some tokens completed no character.
    assert "" in deltas


def test_partial_character_is_held_until_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a🙂", add_special_tokens=False)
    detok = tokenizer.detokenizer()
    assert detok.add(ids[:1]) == "a"
    assert detok.add(ids[1:-1]) == ""
    assert detok.add(ids[-1:]) == "🙂"


def test_flush_emits_an_unfinished_character_as_replacement(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("x中", add_special_tokens=False)
    detok = tokenizer.detokenizer()
    assert detok.add(ids[:1]) == "x"
    assert detok.add(ids[1:-1]) == ""
    flushed = detok.flush()
    assert flushed and set(flushed) == {"\ufffd"}


def test_chunks_of_many_tokens_and_a_prompt_context(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("hello world ", add_special_tokens=False)
    ids = tokenizer.encode(MULTIBYTE * 3, add_special_tokens=False)
    detok = tokenizer.detokenizer(prompt_token_ids=prompt)
    out = "".join(detok.add(ids[i : i + 3]) for i in range(0, len(ids), 3))
    assert out == MULTIBYTE * 3


def test_a_prompt_cut_inside_a_character_lends_the_output_none_of_its_bytes(tokenizer: Tokenizer) -> None:
    """The output is the text of the output tokens alone, even where the prompt's last bytes and the
    output's first ones would make one character together."""
    prompt = tokenizer.encode("hi 中", add_special_tokens=False)
    ids = tokenizer.encode("中", add_special_tokens=False)
    assert len(ids) > 1
    cut = len(prompt) - len(ids) + 1  # the prompt ends one byte into the character
    output = prompt[cut:] + tokenizer.encode(" ok", add_special_tokens=False)
    detok = tokenizer.detokenizer(prompt_token_ids=prompt[:cut])
    text = "".join(detok.add([i]) for i in output) + detok.flush()
    assert text == tokenizer.decode(output) and text.endswith(" ok")


def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode("hello", add_special_tokens=False) + [eos]
    skip = tokenizer.detokenizer(skip_special_tokens=True)
    keep = tokenizer.detokenizer(skip_special_tokens=False)
    assert "".join(skip.add([i]) for i in ids) == "hello"
    assert "".join(keep.add([i]) for i in ids) == "hello</s>"


def test_vocabulary_facts(tokenizer: Tokenizer) -> None:
    assert 2 + 256 <= tokenizer.vocab_size <= 300  # specials, every byte, then merges
    assert tokenizer.eos_token_ids == (1,)
    assert tokenizer.bos_token_id == 0
    assert tokenizer.all_special_ids == frozenset({0, 1})
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"


def test_fallback_chat_template(tokenizer: Tokenizer) -> None:
    assert not tokenizer.has_chat_template
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.render_chat(messages) == "system: Be terse.\nuser: Hi\nassistant:"
    assert tokenizer.render_chat(messages, add_generation_prompt=False) == "system: Be terse.\nuser: Hi\n"
    assert "{{ message['role'] }}" in FALLBACK_CHAT_TEMPLATE
    assert tokenizer.decode(tokenizer.encode_chat(messages)) == "system: Be terse.\nuser: Hi\nassistant:"


def test_model_chat_template_and_extra_eos(chat_tokenizer: Tokenizer) -> None:
    assert chat_tokenizer.has_chat_template
    messages = [{"role": "user", "content": "hello"}]
    assert chat_tokenizer.render_chat(messages) == "<s><|user|>hello</s><|assistant|>"
    ids = chat_tokenizer.encode_chat(messages)
    # The template writes BOS itself: it must not be added a second time.
    assert ids.count(chat_tokenizer.bos_token_id) == 1 and ids[0] == chat_tokenizer.bos_token_id
    assert chat_tokenizer.eos_token_ids == (1, 0)


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        Tokenizer.from_dir(tmp_path)


def test_token_bytes_of_byte_level_pieces_rebuild_the_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == MULTIBYTE.encode()
    # Some token holds part of a character only: its bytes are that part, not U+FFFD's.
    partial = [p for p in pieces if not _is_utf8(p)]
    assert partial and all(p != "\ufffd".encode() for p in partial)
    bos = tokenizer.bos_token_id
    assert bos is not None and tokenizer.token_bytes(bos) == b"<s>"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_token_bytes_of_sentencepiece_byte_fallback_pieces() -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # A SentencePiece-style vocabulary: "▁" marks a word start, "<0xE2>" pieces stand for single bytes.
    vocab = {"<unk>": 0, "▁hi": 1, "h": 2, "i": 3, "▁": 4,
             **{f"<0x{b:02X}>": 5 + b for b in range(256)}}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    sp = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>"))
    ids = sp.encode("hi €", add_special_tokens=False)
    assert [sp.token_bytes(i) for i in ids[-3:]] == [b"\xe2", b"\x82", b"\xac"]
    assert b"".join(sp.token_bytes(i) for i in ids) == " hi €".encode()  # Metaspace adds the leading space
    assert sp.token_bytes(1) == b" hi"
