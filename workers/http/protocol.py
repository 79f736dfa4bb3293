"""Request and response bodies of the OpenAI-compatible API.

Requests accept OpenAI's fields plus the usual server extensions (`top_k`,
`min_p`, `repetition_penalty`, `ignore_eos`, `return_token_ids`, ...). Nothing
a client sends is silently ignored: a field that is not declared here is kept
(`model_extra`) and judged by `prepare.check_extra_fields` against the lists in
`fields.py` (accepted as harmless, or refused by name). Range checks of
sampling fields live in `SamplingParams`, so both edges (HTTP and gRPC) share them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# --- errors -----------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    code: int | str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --- requests ---------------------------------------------------------------


# Strict: JSON's types as written, so `true` is not a token id and "yes" not a bool.
# The top-level bodies keep unknown fields to refuse or accept them by name;
# nested objects refuse them outright (pydantic names the field).
_REQUEST = ConfigDict(extra="forbid", strict=True)
_BODY = ConfigDict(extra="allow", strict=True)


class NullMeansDefault(BaseModel):
    """OpenAI's optional fields are nullable: a declared field sent as null gets
    its default, as when it is left out (clients write `"n": null`, `"stream": null`)."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_to_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}


class StreamOptions(NullMeansDefault):
    model_config = _REQUEST

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage
    # OpenAI's padding of chunks against a network side channel: accepted, none is added.
    include_obfuscation: bool = False


class SamplingFields(NullMeansDefault):
    """Fields both endpoints share."""

    model_config = _BODY

    model: str | None = None  # None: the served model (as vLLM)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    user: str | None = None
    # Structured outputs: OpenAI's response_format, vLLM's guided_* (structured.py).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's newer form of guided_*: {"json": ...}, {"regex": ...}, {"choice": [...]} or {"grammar": ...}.
    structured_outputs: dict[str, Any] | None = None
    # Token id (a JSON key, so a string) -> value added to its logit, in [-100, 100].
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0  # vLLM's: no end of sequence, stop token or stop string before this many
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many alternatives


class CompletionRequest(SamplingFields):
    # A list of token ids is one tokenized prompt; a list of strings or of id lists is a batch.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


# Tool calling (tools.py gives these fields their meaning).


class FunctionSpec(BaseModel):
    model_config = _REQUEST

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None  # arguments always follow the schema when a call is enforced


class ToolSpec(BaseModel):
    model_config = _REQUEST

    type: Literal["function"]
    function: FunctionSpec


class FunctionCall(BaseModel):
    model_config = _REQUEST

    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    model_config = _REQUEST

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class HistoryFunctionCall(FunctionCall):
    # The openai client's parse()/stream() helpers add the arguments parsed, output only: ignored.
    parsed_arguments: Any = None


class HistoryToolCall(ToolCall):
    """A call of an assistant message replayed as history."""

    index: int | None = None  # a streamed delta's place, which stream helpers leave on: ignored
    function: HistoryFunctionCall


class ChatMessage(BaseModel):
    model_config = _BODY  # a replayed response message carries `refusal`, `annotations`, ... (fields.py)

    role: str
    # OpenAI's content parts: only {"type": "text", "text": ...} carry meaning here.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message answers this call


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: further variables of the chat template
    tools: list[ToolSpec] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}; checked in tools.py.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a `prompt` as /v1/completions reads it, or `messages` (with
    `tools`) as /v1/chat/completions renders them."""

    model_config = _REQUEST

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # a prompt's BOS and the like
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = _REQUEST

    model: str | None = None
    tokens: list[int]


# --- responses --------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache (on PD: the prefill's)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # Our extension, on a prefill: "prefill" (it served the request itself) or "prefill+decode"
    # (handed off). Absent on a mixed worker.
    served_by: str | None = None

    @model_serializer(mode="wrap")
    def _without_absent_extension(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("served_by") is None:
            data.pop("served_by", None)
        return data


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    # None for an echoed prompt's first token, which nothing precedes (as OpenAI and vLLM).
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`, keyed by token id."""

    logprob: float
    rank: int | None = None  # 1 + the number of likelier tokens
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt token, its own entry and the top ones (the first token: None).
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM puts a chat prompt's here


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int  # the call's place among the choice's calls: a client joins the deltas of one index
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "disagg"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
