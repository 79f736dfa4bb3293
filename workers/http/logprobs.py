"""Logprobs in the API's shapes: /v1/completions' (an echoed prompt's tokens
first, the very first with none), chat's (each token with its real UTF-8
bytes), and vLLM's `prompt_logprobs` (per prompt token, by token id)."""

from __future__ import annotations

from collections.abc import Sequence

from disagg.workers.engine.outputs import TokenLogprob
from disagg.workers.engine.tokenizer import Tokenizer
from disagg.workers.http.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
)

# (token id, its logprob entry): None for a prompt's first token, which nothing precedes.
Entry = tuple[int, TokenLogprob | None]


def sampled_entries(logprobs: Sequence[TokenLogprob]) -> list[Entry]:
    return [(lp.token_id, lp) for lp in logprobs]


def prompt_entries(prompt: Sequence[int], logprobs: Sequence[TokenLogprob | None]) -> list[Entry]:
    """An echoed prompt's entries: the engine's prompt logprobs go token by token."""
    assert len(prompt) == len(logprobs), "one prompt logprob entry per prompt token"
    return list(zip(prompt, logprobs))


def completion_logprobs(tokenizer: Tokenizer, entries: Sequence[Entry], text_offset: int,
                        num_top: int) -> CompletionLogprobs:
    """`num_top`: alternatives per token (a prompt's may have more, for `prompt_logprobs`)."""
    result = CompletionLogprobs()
    for token_id, lp in entries:
        token = tokenizer.token_text(token_id)
        result.tokens.append(token)
        result.token_logprobs.append(None if lp is None else lp.logprob)
        top: dict[str, float] | None = None
        if lp is not None:
            top = {}
            for alternative, logprob in lp.top[:num_top]:
                # NOTE: distinct tokens can share a text (byte pieces all read
                # as U+FFFD); the format keys by text, so the likelier one stays.
                top.setdefault(tokenizer.token_text(alternative), logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> ChatTopLogprob:
        # The token's own bytes, not its text's: a piece of a character has no text of its own.
        raw = tokenizer.token_bytes(token_id)
        return ChatTopLogprob(token=tokenizer.token_text(token_id), logprob=logprob, bytes=list(raw))

    content = []
    for lp in logprobs:
        head = entry(lp.token_id, lp.logprob)
        content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=[entry(t, v) for t, v in lp.top]))
    return ChatLogprobs(content=content)


def vllm_prompt_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob | None],
                         num_top: int) -> PromptLogprobs:
    """vLLM's shape: per prompt token {token id: {logprob, rank, decoded_token}}, its own
    entry first, then its `num_top` likeliest (ranks 1, 2, ...)."""
    out: PromptLogprobs = []
    for lp in logprobs:
        if lp is None:
            out.append(None)
            continue
        ranked = {str(lp.token_id): PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                                  decoded_token=tokenizer.token_text(lp.token_id))}
        for rank, (token_id, logprob) in enumerate(lp.top[:num_top], start=1):
            ranked.setdefault(str(token_id), PromptLogprob(logprob=logprob, rank=rank,
                                                           decoded_token=tokenizer.token_text(token_id)))
        out.append(ranked)
    return out
