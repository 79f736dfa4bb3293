"""The model's tokenizer: text <-> token ids, the chat template, end-of-sequence
ids, and incremental detokenization for streaming."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Used when a model ships no chat template. Each message becomes
# "<role>: <content>" on its own line, and the prompt ends with "assistant:"
# so that the model continues as the assistant:
#     system: You are terse.
#     user: Hi
#     assistant:
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# Tokens of context decoded in front of the new ones: enough for tokenizers
# whose output for a token depends on its neighbours (SentencePiece's leading
# space, byte-fallback pieces that only form a character together).
_DETOKENIZER_CONTEXT = 6

_REPLACEMENT_CHAR = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback
_SPACE_PIECE = "\u2581"  # SentencePiece's word boundary: a space


class Tokenizer:
    """One model's tokenizer, wrapping a Hugging Face tokenizer."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, extra_eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos = [] if hf_tokenizer.eos_token_id is None else [int(hf_tokenizer.eos_token_id)]
        eos += [int(i) for i in extra_eos_token_ids if int(i) not in eos]
        self._eos_token_ids = tuple(eos)
        self._has_chat_template = bool(getattr(hf_tokenizer, "chat_template", None))
        # len() counts added tokens too, which vocab_size leaves out.
        self._vocab_size = len(hf_tokenizer)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model folder.

        End-of-sequence ids come from the tokenizer and also from the folder's
        `generation_config.json` and `config.json` (instruct models often stop
        on an id that the tokenizer does not name as its eos token).
        """
        from transformers import AutoTokenizer

        path = Path(model_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer folder {path} does not exist")
        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from exc
        return cls(hf, _eos_ids_from_configs(path))

    # --- vocabulary -----------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (base vocabulary plus added tokens)."""
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        bos = self.hf.bos_token_id
        return None if bos is None else int(bos)

    @property
    def all_special_ids(self) -> frozenset[int]:
        return frozenset(int(i) for i in self.hf.all_special_ids)

    @property
    def has_chat_template(self) -> bool:
        return self._has_chat_template

    # --- text <-> ids ---------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """The text of one token alone, special tokens included (for logprobs)."""
        return self.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, a part of a character included (a byte-fallback
        piece, or a byte-level piece that splits one), so that concatenating the bytes of a
        text's tokens rebuilds the text's UTF-8 exactly."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or token_id in self._added_token_ids:
            return self.token_text(token_id).encode("utf-8")
        if (byte := _BYTE_PIECE.fullmatch(piece)) is not None:
            return bytes([int(byte.group(1), 16)])
        if self._is_byte_level:
            return bytes(_byte_level_alphabet()[c] for c in piece)
        return piece.replace(_SPACE_PIECE, " ").encode("utf-8")

    @functools.cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(int(i) for i in self.hf.get_added_vocab().values())

    @functools.cached_property
    def _is_byte_level(self) -> bool:
        """Whether pieces spell bytes in GPT-2's byte-level alphabet (checked on the whole vocabulary)."""
        alphabet = _byte_level_alphabet()
        decoder = getattr(getattr(self.hf, "backend_tokenizer", None), "decoder", None)
        return type(decoder).__name__ == "ByteLevel" and all(
            c in alphabet for piece, i in self.hf.get_vocab().items() if i not in self._added_token_ids for c in piece)

    # --- chat -----------------------------------------------------------

    @property
    def template_takes_tools(self) -> bool:
        """Whether the model's own chat template renders `tools` (it reads the variable)."""
        return self._has_chat_template and "tools" in str(self.hf.chat_template)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text of a conversation, by the model's chat template, or
        by FALLBACK_CHAT_TEMPLATE when the model has none. `tools` (OpenAI's
        tool specs) go to a template that takes them (`template_takes_tools`);
        `template_kwargs` are further template variables (Qwen3's `enable_thinking`)."""
        template = None if self._has_chat_template else FALLBACK_CHAT_TEMPLATE
        text = self.hf.apply_chat_template(
            [dict(m) for m in messages],
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            tools=[dict(t) for t in tools] if tools else None,
            **(template_kwargs or {}),
        )
        assert isinstance(text, str), f"apply_chat_template(tokenize=False) returned {type(text).__name__}"
        return text

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation's prompt.

        A model's own template writes its special tokens (BOS included) as
        text, so they are not added again; the fallback template writes none,
        so the tokenizer adds its usual ones.
        """
        text = self.render_chat(messages, add_generation_prompt, tools, template_kwargs)
        return self.encode(text, add_special_tokens=not self._has_chat_template)

    def detokenizer(self, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas as they arrive.

    Each delta is the text that a window of recent tokens adds over the same
    window without the newest ones. A delta whose text would end in U+FFFD
    (the tokens so far stop inside a multi-byte character) is held back until
    the character is complete, so the concatenated deltas never contain
    broken UTF-8 and equal the text of all output tokens.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # ids[prefix:read] is text already emitted; ids[read:] is pending.
        self._ids: list[int] = list(prompt_token_ids[-_DETOKENIZER_CONTEXT:])
        # A prompt that stops inside a character must not lend its bytes to the output's first one.
        while self._ids and tokenizer.decode(self._ids, skip_special_tokens).endswith(_REPLACEMENT_CHAR):
            self._ids.pop()
        self._prefix = 0
        self._read = len(self._ids)
        self._text_parts: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text_parts)

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the new text that is safe to emit (may be "")."""
        self._ids.extend(token_ids)
        delta = self._delta()
        if delta is None or delta.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._emit(delta)

    def flush(self) -> str:
        """At the end of a request: emit whatever is still held back, broken
        characters included (as U+FFFD), since no more tokens will complete them."""
        delta = self._delta()
        return "" if not delta else self._emit(delta)

    def _delta(self) -> str | None:
        if self._read == len(self._ids):
            return None
        decode = self._tokenizer.decode
        emitted = decode(self._ids[self._prefix : self._read], self._skip_special_tokens)
        full = decode(self._ids[self._prefix :], self._skip_special_tokens)
        # NOTE: a tokenizer may rewrite the window's start once more tokens
        # follow (cleanup of spaces); then only the part past the common
        # prefix is new.
        if full.startswith(emitted):
            return full[len(emitted) :]
        common = 0
        while common < min(len(full), len(emitted)) and full[common] == emitted[common]:
            common += 1
        return full[common:]

    def _emit(self, delta: str) -> str:
        # Slide the window: what was pending is now the context of the next delta.
        self._prefix = self._read
        self._read = len(self._ids)
        if self._read - self._prefix > _DETOKENIZER_CONTEXT:
            self._prefix = self._read - _DETOKENIZER_CONTEXT
        self._text_parts.append(delta)
        return delta


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level spelling of bytes as characters: printable Latin-1 bytes stand
    for themselves, the other bytes, in order, for the code points from 256 up."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    alphabet, others = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + others)] = byte
            others += 1
    return alphabet


def _eos_ids_from_configs(model_dir: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids
