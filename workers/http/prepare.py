"""Turns an API request into what the backend runs: prompt token ids and
`SamplingParams`, validated. Every problem becomes a 4xx `APIError` here,
before the engine sees the request."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from jinja2 import TemplateError

from disagg.workers.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from disagg.workers.engine.tokenizer import Tokenizer
from disagg.workers.http.backend import ModelInfo
from disagg.workers.http.errors import BadRequest, ContextLengthExceeded, ModelNotFound
from disagg.workers.http.fields import check_extra_fields, check_message_fields
from disagg.workers.http.protocol import CHAT_ROLES, ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from disagg.workers.http.structured import Constraint, structured_output
from disagg.workers.http.tools import ToolPlan, history_calls, plan_tools, render_input

MAX_BATCH_PROMPTS = 64  # prompts of one /v1/completions request: each runs as its own sequences


@dataclass(frozen=True)
class Echo:
    """/v1/completions' `echo`: each prompt's text (and logprobs, if asked) comes before its choices' output."""

    texts: tuple[str, ...]  # one per prompt
    drop_output: bool  # `max_tokens: 0`: the token made to end the prompt's forward is not returned


@dataclass(frozen=True)
class Prepared:
    prompt_token_ids: list[int]
    params: SamplingParams
    tools: ToolPlan | None = None  # offered tools: the output is parsed for calls
    # /v1/completions' batch: the further prompts; prompt i's choices have indexes i * n ... i * n + n - 1.
    more_prompts: tuple[list[int], ...] = ()
    echo: Echo | None = None

    @property
    def prompts(self) -> list[list[int]]:
        return [self.prompt_token_ids, *self.more_prompts]


def check_model(requested: str | None, model: ModelInfo) -> None:
    """None (no `model` sent) is the served model, as vLLM reads it."""
    if requested is not None and requested not in (model.name, model.source):
        raise ModelNotFound(requested, model.name)


def prepare_completion(req: CompletionRequest, model: ModelInfo, tokenizer: Tokenizer) -> Prepared:
    check_model(req.model, model)
    check_extra_fields(req)
    prompts = _prompts(req.prompt)
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise BadRequest(f"at most {MAX_BATCH_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    texts: list[str] = []
    all_ids: list[list[int]] = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt) if prompt else []
        else:
            ids = list(prompt)
            check_token_ids(ids, model)
        if not ids:
            raise BadRequest("prompt must not be empty", "prompt")
        if req.echo:
            texts.append(prompt if isinstance(prompt, str) else tokenizer.decode(ids, skip_special_tokens=False))
        all_ids.append(ids)
    # `max_tokens: 0` (echo only, as OpenAI): one token ends the prompt's forward, and is dropped.
    drop_output = req.echo and req.max_tokens == 0
    max_tokens = 1 if drop_output else req.max_tokens
    # Echoed logprobs are the prompt's own first: its forward gives them (the engine's prompt logprobs).
    echo_logprobs = req.logprobs if req.echo else None
    prompt_logprobs = max((k for k in (echo_logprobs, req.prompt_logprobs) if k is not None), default=None)
    constraint = structured_output(req)
    params = _sampling_params(req, max_tokens, req.logprobs, max(all_ids, key=len), model, prompt_logprobs,
                              None if constraint is None else constraint.grammar)
    echo = Echo(tuple(texts), drop_output) if req.echo else None
    return Prepared(all_ids[0], params, more_prompts=tuple(all_ids[1:]), echo=echo)


def _prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str] | list[list[int]]:
    """A completion's prompts: a string or one id list is one; a list of either is a batch."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]  # pydantic took it as list[int]
    return prompt  # type: ignore[return-value]  # list[str] or list[list[int]]


def prepare_chat(req: ChatCompletionRequest, model: ModelInfo, tokenizer: Tokenizer,
                 names: Mapping[str, str] | None = None) -> Prepared:
    """`names`: the fields a 400 names where the client sent another API's (the Responses API's
    max_output_tokens); by default the chat fields the client used."""
    check_model(req.model, model)
    check_extra_fields(req)
    constraint = structured_output(req)
    ids, plan = chat_prompt(req, tokenizer, constraint)
    if req.top_logprobs is not None and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    newer = req.max_completion_tokens is not None
    max_tokens = req.max_completion_tokens if newer else req.max_tokens
    sent = {"max_tokens": "max_completion_tokens" if newer else "max_tokens", "logprobs": "top_logprobs"}
    params = _sampling_params(req, max_tokens, logprobs, ids, model, req.prompt_logprobs,
                              None if constraint is None else constraint.grammar, {**sent, **(names or {})})
    if plan is not None and plan.grammar is not None:  # it holds the constraint's format, if any
        params = replace(params, grammar=plan.grammar)
    return Prepared(ids, params, plan if plan is not None and plan.offered else None)


# What the chat path itself passes to apply_chat_template: chat_template_kwargs may not override it.
_TEMPLATE_ARGUMENTS = frozenset({"messages", "conversation", "tools", "add_generation_prompt", "chat_template",
                                 "tokenize", "return_dict", "continue_final_message", "documents", "tokenizer_kwargs"})


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer,
                constraint: Constraint | None = None) -> tuple[list[int], ToolPlan | None]:
    """The token ids of a chat request's prompt (its messages and the tools it offers, in the
    model's template), and its tool plan (whose grammar holds `constraint`'s format)."""
    if not req.messages:
        raise BadRequest("messages must not be empty", "messages")
    plan = plan_tools(req, constraint)
    messages, tools = render_input([_message(i, m) for i, m in enumerate(req.messages)], plan,
                                   tokenizer.template_takes_tools)
    taken = _TEMPLATE_ARGUMENTS.intersection(req.chat_template_kwargs or {})
    if taken:
        raise BadRequest(f"chat_template_kwargs may not set {', '.join(sorted(taken))}: the request's own fields do",
                         "chat_template_kwargs")
    try:
        ids = tokenizer.encode_chat(messages, add_generation_prompt=req.add_generation_prompt, tools=tools,
                                    template_kwargs=req.chat_template_kwargs)
    except TemplateError as exc:
        raise BadRequest(f"the chat template rejected the messages: {exc}", "messages") from exc
    if not ids:
        raise BadRequest("the messages render to an empty prompt", "messages")
    return ids, plan


def _message(index: int, message: ChatMessage) -> dict[str, Any]:
    """The message as the chat template sees it (Hugging Face's form); `name`
    goes along for templates that use it."""
    check_message_fields(index, message.role, message.model_extra)
    if message.role not in CHAT_ROLES:
        raise BadRequest(f"unknown message role {message.role!r}: expected one of {', '.join(CHAT_ROLES)}", "messages")
    if message.tool_calls and message.role != "assistant":
        raise BadRequest(f"messages[{index}]: only an assistant message has tool_calls", "messages")
    if (message.role == "tool") != (message.tool_call_id is not None):
        raise BadRequest(f"messages[{index}]: a tool message needs a tool_call_id, and only a tool message has one",
                         "messages")
    # An assistant message that calls tools may have no text.
    text = "" if message.content is None and message.tool_calls else _message_text(message)
    rendered: dict[str, Any] = {"role": message.role, "content": text}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_calls:
        rendered["tool_calls"] = history_calls(index, message.tool_calls)
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _message_text(message: ChatMessage) -> str:
    content = message.content
    if content is None:
        raise BadRequest(f"a {message.role} message needs content (a string or text parts), got null", "messages")
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type")
        # A replayed assistant message may hold OpenAI's refusal part: what it said, as text.
        if kind != "text" and not (kind == "refusal" and message.role == "assistant"):
            raise BadRequest(f"only text content parts (and an assistant's refusal parts) are supported, "
                             f"got {kind!r}", "messages")
        text = part.get(kind)
        if not isinstance(text, str):
            raise BadRequest(f"a {kind} content part needs its {kind!r} string", "messages")
        texts.append(text)
    return "".join(texts)


def check_token_ids(ids: list[int] | tuple[int, ...], model: ModelInfo, field: str = "prompt") -> None:
    bad = [i for i in ids if not 0 <= i < model.vocab_size]
    if bad:
        raise BadRequest(
            f"{field} token ids must be in [0, {model.vocab_size}); got {bad[:5]}" + (" ..." if len(bad) > 5 else ""),
            field,
        )


def _logit_bias(req: SamplingFields, model: ModelInfo) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, value) pairs; a 400 naming the field for a key that is not
    a token id of the vocabulary or a value outside [-100, 100]."""
    pairs = []
    for key, value in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or not int(key) < model.vocab_size:  # "²" is a digit
            raise BadRequest(f"logit_bias keys must be token ids in [0, {model.vocab_size}), got {key!r}", "logit_bias")
        if not (math.isfinite(value) and abs(value) <= MAX_LOGIT_BIAS):
            raise BadRequest(f"logit_bias values must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, "
                             f"got {value} for token {key}", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _sampling_params(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_ids: list[int], model: ModelInfo,
    prompt_logprobs: int | None = None, grammar: str | None = None, names: Mapping[str, str] | None = None,
) -> SamplingParams:
    """The engine's parameters; a 400 names the field as the client sent it (`names`: the
    engine's field -> the request's, where they differ)."""
    sent = names or {}
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
    room = model.max_model_len - len(prompt_ids)
    if room < 1:
        raise ContextLengthExceeded(model.max_model_len, len(prompt_ids),
                                    "that leaves no room to generate. Please shorten the prompt.",
                                    "prompt" if isinstance(req, CompletionRequest) else "messages")
    if max_tokens is None:
        max_tokens = room  # OpenAI's chat default: as long as the context allows
    elif max_tokens > room:
        field = sent.get("max_tokens", "max_tokens")
        raise ContextLengthExceeded(model.max_model_len, len(prompt_ids),
                                    f"{field} is {max_tokens}, and at most {room} tokens can be generated. Please "
                                    f"reduce the prompt or {field}.", field)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    check_token_ids(req.stop_token_ids or (), model, "stop_token_ids")
    if req.prompt_logprobs is not None and req.stream and isinstance(req, ChatCompletionRequest):
        # A chat chunk has no place for them (vLLM refuses them too); completions stream them.
        raise BadRequest("prompt_logprobs cannot be streamed on chat completions", "prompt_logprobs")
    if req.min_tokens and grammar is not None:
        # The grammar may allow nothing but its end where min_tokens forbids it.
        raise BadRequest("min_tokens cannot be combined with a structured-output constraint", "min_tokens")
    # Beyond the vocabulary a cut keeps every token; refusing it keeps huge values out of the engine.
    if req.top_k is not None and req.top_k > model.vocab_size:
        raise BadRequest(f"top_k must be at most the vocabulary size {model.vocab_size}, got {req.top_k}", "top_k")
    optional: dict[str, Any] = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    for name, value in optional.items():
        # JSON's NaN parses as a float; SamplingParams rejects it too, this only words it better.
        if isinstance(value, float) and math.isnan(value):
            raise BadRequest(f"{name} must be a number, got NaN", name)
    try:
        return SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            seed=req.seed,
            stop=tuple(s for s in stop if s),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=_logit_bias(req, model),
            min_tokens=req.min_tokens,
            skip_special_tokens=req.skip_special_tokens,
            grammar=grammar,
            **{k: v for k, v in optional.items() if v is not None},
        )
    except ValueError as exc:
        # SamplingParams words each problem as "<field> must ...".
        name, _, rest = str(exc).partition(" ")
        if name not in SamplingParams.__dataclass_fields__:
            raise BadRequest(str(exc)) from exc
        raise BadRequest(f"{sent.get(name, name)} {rest}", sent.get(name, name)) from exc
