"""OpenAI's Responses API (`POST /v1/responses`) over the chat path.

A request becomes a chat request (instructions as a system message first, then
the input items: messages, earlier function calls and their outputs) and runs
as one, tools and structured outputs included. Its output is built into
Responses items as it arrives: text into a message item, each tool call into a
function_call item. A stream sends the events that build them (`event:` and
`data:` lines, numbered by `sequence_number`, no `[DONE]`), ending with
`response.completed` or `response.incomplete`, or `response.failed` when the
request fails after the stream began; a whole response is the last event's.

Nothing is stored (`store` is accepted, and every response says `store:
false`): `previous_response_id` and `conversation` are refused with a 400
that says to send the conversation's items as input, which is what clients
that keep their own history (the Agents SDK, Codex with `store: false`) do.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from disagg.workers.engine.outputs import FinishReason
from disagg.workers.http.errors import APIError, BadRequest
from disagg.workers.http.fanout import ClientDisconnected
from disagg.workers.http.fields import Refused, check_extra_fields, noop_if
from disagg.workers.http.protocol import ChatCompletionRequest, ToolCallDelta
from disagg.workers.http.tool_parser import ToolCallParser
from disagg.workers.http.responses_protocol import (
    FunctionCallInput, FunctionCallItem, FunctionCallOutputInput, FunctionTool, IncompleteDetails,
    InputTokensDetails, MessageInput, OutputItem, OutputMessage, OutputText, ResponseError, ResponseObject,
    ResponsesRequest, ResponseUsage, new_id,
)
from disagg.workers.http.serving import Call, OpenAIServing

log = logging.getLogger(__name__)

Event = dict[str, Any]  # one stream event, without its sequence number
_Item = TypeVar("_Item", bound=BaseModel)

HARMLESS: dict[str, str] = {
    "store": "nothing is stored; every response says store: false",
    "service_tier": "OpenAI's billing tier",
    "prompt_cache_key": "a cache-routing hint; the prefix cache works without it",
    "prompt_cache_retention": "OpenAI's cache retention; the prefix cache keeps what fits",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "stream_options": "include_obfuscation pads OpenAI's events against a network side channel",
}

_NOTHING_STORED = "nothing is stored on this server: send the conversation's items as input"

REFUSED: dict[str, Refused] = {
    "previous_response_id": Refused(_NOTHING_STORED),
    "conversation": Refused(_NOTHING_STORED),
    "prompt": Refused("stored prompt templates are not supported"),
    "background": Refused("background responses are not supported", noop_if(False)),
    # A client that sends its defaults (effort and summary null) asks for nothing.
    "reasoning": Refused("this model has no reasoning mode",
                         lambda value, _req: value is None or (isinstance(value, dict)
                                                               and all(v is None for v in value.values()))),
    # A model without reasoning has no reasoning items to include the encrypted content of.
    "include": Refused("only reasoning.encrypted_content (of which there is none) may be included",
                       lambda value, _req: value is None or (isinstance(value, list) and all(
                           v == "reasoning.encrypted_content" for v in value))),
    "truncation": Refused("truncation auto is not supported: a prompt longer than the context is refused",
                          noop_if("disabled")),
    "max_tool_calls": Refused("max_tool_calls is not supported"),
    "top_logprobs": Refused("logprobs are not returned here; /v1/chat/completions returns them", noop_if(0)),
}


# --- the request, as a chat request -------------------------------------------


def translate(req: ResponsesRequest, response_id: str, model_name: str) -> tuple[ChatCompletionRequest, ResponseObject]:
    """The chat request that computes the response (400s name the Responses field), and the
    response as created."""
    tools = function_tools(req.tools or [])
    return chat_request(req, tools), response_template(req, tools, response_id, model_name)


def chat_request(req: ResponsesRequest, tools: list[FunctionTool]) -> ChatCompletionRequest:
    check_extra_fields(req, HARMLESS, REFUSED)
    if req.text is not None and req.text.verbosity is not None:
        raise BadRequest("text.verbosity: this model has no verbosity control", "text")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += input_messages(req.input)
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "user": req.user, "response_format": _response_format(req),
    }
    if tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in tools]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of `input`: a replayed function call joins the assistant message before it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise BadRequest("input must not be empty", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            message = _parsed(MessageInput, item, f"input[{i}]", "input")
            messages.append({"role": message.role, "content": _text(message.content, f"input[{i}].content")})
        elif kind == "function_call":
            call = _parsed(FunctionCallInput, item, f"input[{i}]", "input")
            tool_call = {"id": call.call_id, "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(tool_call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
        elif kind == "function_call_output":
            result = _parsed(FunctionCallOutputInput, item, f"input[{i}]", "input")
            messages.append({"role": "tool", "tool_call_id": result.call_id,
                             "content": _text(result.output, f"input[{i}].output")})
        elif kind == "reasoning":
            raise BadRequest(f"input[{i}]: reasoning items are not supported: this model has no reasoning mode",
                             "input")
        elif kind == "item_reference":
            raise BadRequest(f"input[{i}]: an item reference needs stored items; {_NOTHING_STORED}", "input")
        else:
            raise BadRequest(f"input[{i}]: items of type {kind!r} are not supported: only message, function_call "
                             "and function_call_output", "input")
    return messages


def function_tools(tools: list[dict[str, Any]]) -> list[FunctionTool]:
    parsed = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise BadRequest(f"tools[{i}]: tools of type {tool.get('type')!r} are not supported: only function "
                             "tools, which the client runs", "tools")
        parsed.append(_parsed(FunctionTool, tool, f"tools[{i}]", "tools"))
    return parsed


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """Chat's form of a Responses tool_choice: a named function is {"type": "function", "name"}."""
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or set(choice) != {"type", "name"} or not isinstance(choice["name"], str):
        raise BadRequest('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}, '
                         f"got {choice!r}", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    """Chat's response_format of `text.format`."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict) or not isinstance(fmt.get("name"), str):
            raise BadRequest("text.format of type json_schema needs a `name` and a `schema` object", "text")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise BadRequest(f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}", "text")


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """The text of a content field: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        key = "refusal" if kind == "refusal" else "text"
        if kind not in ("input_text", "output_text", "refusal") or not isinstance(part.get(key), str):
            raise BadRequest(f"{where}[{j}]: only text parts (input_text, output_text) are supported, got {kind!r}",
                             "input")
        texts.append(part[key])
    return "".join(texts)


def _parsed(kind: type[_Item], value: dict[str, Any], where: str, param: str) -> _Item:
    try:
        return kind.model_validate(value)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        location = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
        raise BadRequest(f"{where}{location}: {error['msg']}", param) from None


def response_template(req: ResponsesRequest, tools: list[FunctionTool], response_id: str,
                      model_name: str) -> ResponseObject:
    """The response as created: the request's settings, no output yet."""
    return ResponseObject(
        id=response_id, model=model_name, instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls is not False, temperature=req.temperature, top_p=req.top_p,
        tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
        tools=[t.model_dump(exclude_none=True) for t in tools],
        text={"format": req.text.format} if req.text is not None and req.text.format is not None else
        {"format": {"type": "text"}},
        metadata=req.metadata or {}, user=req.user,
    )


# --- the output, as items and events ------------------------------------------


class OutputBuilder:
    """A response's output items as its text and calls arrive, and the events that build them:
    text goes into a message item, opened by its first text and closed by a call or the end."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._message: OutputMessage | None = None

    def text(self, delta: str) -> list[Event]:
        if not delta:
            return []
        events = []
        message = self._message
        if message is None:
            message = self._message = OutputMessage(id=new_id("msg"), status="in_progress")
            self.items.append(message)
            events.append(self._item_event("response.output_item.added", message))
            message.content.append(OutputText(text=""))
            events.append(self._part_event("response.content_part.added", message))
        message.content[0].text += delta
        events.append({**self._text_where("response.output_text.delta", message), "delta": delta, "logprobs": []})
        return events

    def call(self, delta: ToolCallDelta) -> list[Event]:
        """A whole call (the parser gives each call in one delta), after the text before it."""
        assert delta.id is not None and delta.function is not None and delta.function.name is not None
        arguments = delta.function.arguments or ""
        events = self.finish("completed")
        item = FunctionCallItem(id=new_id("fc"), call_id=delta.id, name=delta.function.name, arguments="",
                                status="in_progress")
        self.items.append(item)
        events.append(self._item_event("response.output_item.added", item))
        where = {"item_id": item.id, "output_index": len(self.items) - 1}
        events.append({"type": "response.function_call_arguments.delta", **where, "delta": arguments})
        events.append({"type": "response.function_call_arguments.done", **where, "arguments": arguments})
        item.arguments, item.status = arguments, "completed"
        events.append(self._item_event("response.output_item.done", item))
        return events

    def finish(self, status: str) -> list[Event]:
        """Close the open message item, if any, as "completed" or "incomplete"."""
        message, self._message = self._message, None
        if message is None:
            return []
        events = [{**self._text_where("response.output_text.done", message), "text": message.content[0].text,
                   "logprobs": []},
                  self._part_event("response.content_part.done", message)]
        message.status = "completed" if status == "completed" else "incomplete"
        events.append(self._item_event("response.output_item.done", message))
        return events

    def _item_event(self, kind: str, item: OutputItem) -> Event:
        return {"type": kind, "output_index": self.items.index(item), "item": item.model_dump()}

    def _part_event(self, kind: str, message: OutputMessage) -> Event:
        return {**self._text_where(kind, message), "part": message.content[0].model_dump()}

    def _text_where(self, kind: str, message: OutputMessage) -> Event:
        return {"type": kind, "item_id": message.id, "output_index": self.items.index(message), "content_index": 0}


def _status(finish: FinishReason | None) -> tuple[str, IncompleteDetails | None]:
    if finish is FinishReason.LENGTH:
        return "incomplete", IncompleteDetails(reason="max_output_tokens")
    if finish is FinishReason.ABORT:
        return "incomplete", IncompleteDetails(reason="abort")
    return "completed", None


class ResponseRun:
    """One response computed through the chat path; `final` once its events have all been read."""

    def __init__(self, serving: OpenAIServing, call: Call, template: ResponseObject) -> None:
        self.serving = serving
        self.call = call
        self.template = template
        self.final: ResponseObject | None = None

    async def events(self, wait_disconnect: Callable[[], Awaitable[None]] | None) -> AsyncGenerator[Event, None]:
        """Every event of the response, the last response.completed or response.incomplete;
        raises what the request raises (an APIError for a failure the client should see)."""
        created = self.template.model_dump()
        yield {"type": "response.created", "response": created}
        yield {"type": "response.in_progress", "response": created}
        call = self.call
        builder = OutputBuilder()
        parser = ToolCallParser(call.prepared.tools) if call.prepared.tools is not None else None
        choices = call.new_choices()
        async with aclosing(self.serving.outputs(call, choices, wait_disconnect)) as outputs:
            async for _, out in outputs:
                text, calls = parser.feed(out.new_text, final=out.finished) if parser else (out.new_text, [])
                for event in builder.text(text):
                    yield event
                for delta in calls:
                    for event in builder.call(delta):
                        yield event
        status, details = _status(choices[0].finish_reason)
        for event in builder.finish(status):
            yield event
        usage = call.usage(choices)
        self.final = self.template.model_copy(update={
            "status": status, "incomplete_details": details, "output": builder.items,
            "usage": ResponseUsage(
                input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens,
                input_tokens_details=InputTokensDetails(
                    cached_tokens=usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0)),
        })
        yield {"type": f"response.{status}", "response": self.final.model_dump()}

    async def respond(self, wait_disconnect: Callable[[], Awaitable[None]] | None) -> ResponseObject:
        async with aclosing(self.events(wait_disconnect)) as events:
            async for _ in events:
                pass
        assert self.final is not None
        return self.final

    async def stream(self, wait_disconnect: Callable[[], Awaitable[None]] | None) -> AsyncGenerator[str, None]:
        """The events as server-sent events; a failure after the first is reported in band."""
        sequence = 0
        try:
            async with aclosing(self.events(wait_disconnect)) as events:
                async for event in events:
                    yield _sse(event, sequence)
                    sequence += 1
        except ClientDisconnected:
            return
        except APIError as exc:  # the status line is already sent
            yield _sse(self._failed(exc.code or exc.type, exc.message), sequence)
        except Exception as exc:
            log.exception("streamed response %s failed", self.call.request_id)
            yield _sse(self._failed("server_error", f"internal error: {type(exc).__name__}: {exc}"), sequence)

    def _failed(self, code: str, message: str) -> Event:
        failed = self.template.model_copy(update={"status": "failed", "error": ResponseError(code=code, message=message)})
        return {"type": "response.failed", "response": failed.model_dump()}


def _sse(event: Event, sequence: int) -> str:
    data = json.dumps({**event, "sequence_number": sequence}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"
