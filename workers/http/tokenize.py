"""vLLM's /tokenize and /detokenize: text as the token ids a request would see, and back.

A conversation goes through the chat endpoint's own path (template, tools,
generation prompt), so its `count` is the `usage.prompt_tokens` the same
messages get from /v1/chat/completions; an agent can budget its context with
it. Both run in a thread: tokenising a long body takes long.
"""

from __future__ import annotations

from disagg.workers.engine.tokenizer import Tokenizer
from disagg.workers.http.backend import ModelInfo
from disagg.workers.http.edge import parse_body
from disagg.workers.http.errors import BadRequest
from disagg.workers.http.prepare import chat_prompt, check_model, check_token_ids
from disagg.workers.http.protocol import (
    ChatCompletionRequest, DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
)


def tokenize(raw: bytes, model: ModelInfo, tokenizer: Tokenizer) -> TokenizeResponse:
    req = parse_body(TokenizeRequest, raw)
    check_model(req.model, model)
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("give either prompt or messages", "prompt" if req.prompt is None else "messages")
    if req.messages is None:
        assert req.prompt is not None
        if req.tools is not None or req.tool_choice is not None:
            raise BadRequest("tools come with messages, not with a prompt", "tools")
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        if not req.add_special_tokens:
            # The chat path adds what the template does not write; it takes no switch.
            raise BadRequest("add_special_tokens applies to a prompt; with messages the template decides",
                             "add_special_tokens")
        chat = ChatCompletionRequest(model=req.model, messages=req.messages, tools=req.tools,
                                     tool_choice=req.tool_choice, add_generation_prompt=req.add_generation_prompt)
        ids, _ = chat_prompt(chat, tokenizer)
    strs = [str(t) for t in tokenizer.hf.convert_ids_to_tokens(ids)] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=model.max_model_len, tokens=ids, token_strs=strs)


def detokenize(raw: bytes, model: ModelInfo, tokenizer: Tokenizer) -> DetokenizeResponse:
    req = parse_body(DetokenizeRequest, raw)
    check_model(req.model, model)
    check_token_ids(req.tokens, model, "tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens, skip_special_tokens=False))

