"""Bodies of OpenAI's Responses API (`POST /v1/responses`), the shape the
openai client's `responses.create` and agent frameworks built on it send and read.

The request's `input` items and `tools` are kept as plain objects here and read
one by one in responses.py, so that a 400 names the item (`input[2]`) a client
sent; the top-level fields are strict, unknown ones judged by name as the
completion endpoints' are (fields.py).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from disagg.workers.http.protocol import now

_REQUEST = ConfigDict(extra="forbid", strict=True)


def new_id(prefix: str) -> str:
    """OpenAI's ids of the Responses API: `resp_…`, `msg_…`, `fc_…`."""
    return f"{prefix}_{uuid.uuid4().hex}"


# --- the request ------------------------------------------------------------


class TextConfig(BaseModel):
    model_config = _REQUEST

    # {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema", "strict"}
    format: dict[str, Any] | None = None
    verbosity: str | None = None  # refused unless null: this model has no verbosity control


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None  # None: the served model (as vLLM)
    input: str | list[dict[str, Any]]
    instructions: str | None = None  # a system message before the input
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # OpenAI documents these two as nullable: null is the default.
    stream: bool | None = False
    # Function tools, flat: {"type": "function", "name", "description", "parameters", "strict"}
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none", "auto", "required" or {"type": "function", "name"}
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None  # given back in the response; nothing is stored
    user: str | None = None


class _InputItem(BaseModel):
    """What every item of `input` may carry: an item replayed from an earlier response has its id and status."""

    model_config = _REQUEST

    id: str | None = None
    status: str | None = None


class MessageInput(_InputItem):
    """A message item of `input` (its `type` "message" may be left out)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]  # text, or parts: input_text, output_text, refusal
    phase: str | None = None


class FunctionCallInput(_InputItem):
    """A call the model made earlier, replayed."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    # Fields the openai client's own output item has, null on every call this server makes: a
    # history kept as model_dump() dicts replays them. A value (another server's) is refused.
    namespace: None = None
    caller: None = None
    async_: None = Field(None, alias="async")


class FunctionCallOutputInput(_InputItem):
    """A call's result, as the client's function returned it."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]  # text, or input_text parts


class FunctionTool(BaseModel):
    model_config = _REQUEST

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


# --- the response -----------------------------------------------------------


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    """A call the model makes: the client runs it and sends a function_call_output back."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: str  # "max_output_tokens", or "abort" when the server ended the request


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None = None
    max_output_tokens: int | None = None
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    store: Literal[False] = False  # nothing is stored: GET /v1/responses/{id} has nothing to find
    previous_response_id: None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None
