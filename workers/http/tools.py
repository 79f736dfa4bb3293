"""Tool calling in the chat API: OpenAI's `tools`, `tool_choice`,
`parallel_tool_calls`, assistant `tool_calls` and `tool` messages
(docs/openai-api.md, "Tool calling").

One call format, Hermes-style (what the Qwen2.5/Qwen3 and Hermes chat
templates teach their models), used alike to render the history, to enforce
calls and to parse them from the output:

    <tool_call>
    {"name":"get_weather","arguments":{"city":"Paris"}}
    </tool_call>

- Prompt: a chat template that reads `tools` gets the tools and the history in
  Hugging Face's form (assistant `tool_calls` with arguments as objects, `tool`
  messages with `tool_call_id` and the function's `name`). Any other template
  gets ours (`_fallback`): a system preamble listing the tools and the format,
  the assistant's calls as blocks after its text, and each run of tool results
  as one user turn of `<tool_response>` blocks.
- `required` and a named function are enforced (and `auto` when a function
  asks for `strict` arguments): `ToolPlan.grammar` allows exactly the call
  blocks (after text, in `auto`), with arguments valid under the declared
  schema; it rides `SamplingParams.grammar`, so PD carries it as any
  structured output.
- The output (every mode but `none`) is split by `ToolCallParser` into content
  and calls, while streaming too; a block that is not a well-formed call of an
  offered function stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from enum import Enum
from typing import Any

from disagg.workers.engine.grammar import GrammarKind, build_grammar, lark_json
from disagg.workers.http.errors import BadRequest
from disagg.workers.http.protocol import (
    ChatCompletionRequest,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
)

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
_COMPACT = (",", ":")  # the separators the grammar's JSON uses; history is written the same way


class ToolChoice(str, Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "function"


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and what its `tool_choice` asks of the output."""

    tools: tuple[ToolSpec, ...]
    choice: ToolChoice
    parallel: bool
    named: str | None = None
    grammar: str | None = None  # the enforced call format (`enforced`)

    @property
    def offered(self) -> bool:
        """Whether the model is shown the tools and its output parsed for calls."""
        return self.choice is not ToolChoice.NONE

    @property
    def enforced(self) -> bool:
        """Whether the call format is enforced by a grammar: `required`, a named
        function, or `auto` with a function that asks for `strict` arguments."""
        strict = self.choice is ToolChoice.AUTO and any(t.function.strict for t in self.tools)
        return strict or self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)

    @property
    def callable_names(self) -> frozenset[str]:
        return frozenset([self.named] if self.named else (t.function.name for t in self.tools))

    def specs(self) -> list[dict[str, Any]]:
        """The tools as OpenAI writes them (what chat templates expect)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]


def plan_tools(req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan, checked (400s naming `tools` or `tool_choice`);
    None when it offers no tools."""
    tools = tuple(req.tools or ())
    _check_tools(tools)
    choice, named = _tool_choice(req.tool_choice, tools)
    if not tools:
        return None
    plan = ToolPlan(tools, choice, req.parallel_tool_calls, named)
    if not plan.enforced:
        return plan
    if req.ignore_eos:
        raise BadRequest("tool_choice required, a named function or strict tools cannot be combined with "
                         "ignore_eos: the output ends where the enforced call format does", "tool_choice")
    return ToolPlan(tools, choice, req.parallel_tool_calls, named, _call_grammar(plan))


def _check_tools(tools: tuple[ToolSpec, ...]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not NAME.fullmatch(name):
            raise BadRequest(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -, got {name!r}", "tools")
        if name in seen:
            raise BadRequest(f"tools[{i}].function.name {name!r} is not unique", "tools")
        seen.add(name)
        params = tool.function.parameters
        if params is None:
            continue
        if params.get("type", "object") != "object":
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema of an object "
                             f"(type: object), got type {params.get('type')!r}", "tools")
        try:
            build_grammar(GrammarKind.JSON_SCHEMA, params)
        except ValueError as exc:
            raise BadRequest(f"tools[{i}].function.parameters is not a usable JSON schema: {exc}", "tools") from None


def _tool_choice(value: str | dict[str, Any] | None, tools: tuple[ToolSpec, ...]) -> tuple[ToolChoice, str | None]:
    if value is None:  # OpenAI's default
        return (ToolChoice.AUTO if tools else ToolChoice.NONE), None
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise BadRequest(f"tool_choice must be none, auto, required or a named function, got {value!r}",
                             "tool_choice")
        choice = ToolChoice(value)
        if choice is ToolChoice.REQUIRED and not tools:
            raise BadRequest("tool_choice required needs tools", "tool_choice")
        return choice, None
    function = value.get("function")
    if value.get("type") != "function" or set(value) != {"type", "function"} or not isinstance(function, dict) \
            or set(function) != {"name"} or not isinstance(function["name"], str):
        raise BadRequest('a named tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice")
    names = [t.function.name for t in tools]
    if function["name"] not in names:
        raise BadRequest(f"tool_choice names the function {function['name']!r}, which is not among the tools "
                         f"({', '.join(names) or 'none given'})", "tool_choice")
    return ToolChoice.NAMED, function["name"]


# --- the enforced format --------------------------------------------------


def _call_grammar(plan: ToolPlan) -> str:
    """Lark: the call blocks, each a call of one callable function with
    arguments valid under its schema; one block (named, or parallel_tool_calls
    false) or blocks separated by newlines. In `auto`, text (which never holds
    a call's start) may stand alone or come before the blocks."""
    lines = []
    specs = [t for t in plan.tools if t.function.name in plan.callable_names]
    tail = json.dumps(f"}}\n{CALL_CLOSE}")
    for i, tool in enumerate(specs):
        head = json.dumps(f'\n{{"name":{json.dumps(tool.function.name)},"arguments":')
        lines.append(f"body_{i}: {head} args_{i} {tail}")
        lines.append(f"args_{i}: {lark_json(tool.function.parameters or _NO_ARGUMENTS)}")
    separator = json.dumps("\n" + CALL_OPEN)
    more = f"({separator} body)*" if plan.named is None and plan.parallel else ""
    if plan.choice is ToolChoice.AUTO:
        # NOTE: one lexeme for the text and the first opening tag: llguidance's lexer
        # does not backtrack, so text then a separate tag lexeme would never match.
        start = [f"start: (TEXT | OPENER body {more})?",
                 f"TEXT: /(?s:.+)/ & ~/(?s:.*{CALL_OPEN}.*)/",
                 f"OPENER: /(?s:.*{CALL_OPEN})/ & ~/(?s:.*{CALL_OPEN}.+)/"]
    else:
        start = [f"start: {json.dumps(CALL_OPEN)} body {more}"]
    lark = "\n".join([*start, "body: " + " | ".join(f"body_{i}" for i in range(len(specs))), *lines])
    return build_grammar(GrammarKind.LARK, lark)


def format_call(name: str, arguments: dict[str, Any]) -> str:
    """One call block, exactly as the enforced grammar writes it."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False, separators=_COMPACT)}" \
           f"\n{CALL_CLOSE}"


# --- the prompt -------------------------------------------------------------


def history_calls(index: int, calls: list[ToolCall]) -> list[dict[str, Any]]:
    """An assistant message's calls in Hugging Face's form (arguments as an object)."""
    rendered = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise BadRequest(f"messages[{index}].tool_calls: the arguments of {call.id!r} must be a JSON object "
                             f"as text, got {call.function.arguments!r}", "messages")
        rendered.append({"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                         "arguments": arguments}})
    return rendered


def render_input(messages: list[dict[str, Any]], plan: ToolPlan | None,
                 template_takes_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (Hugging Face's form, from prepare) and the tools to give the
    chat template: its own format where it has one, else ours."""
    _name_tool_results(messages)
    offered = plan.specs() if plan is not None and plan.offered else None
    if template_takes_tools:
        return messages, offered
    return _fallback(messages, offered), None


def _name_tool_results(messages: list[dict[str, Any]]) -> None:
    """Each tool message answers an earlier call: give it that function's name (templates show it)."""
    called: dict[str, str] = {}
    for i, message in enumerate(messages):
        for call in message.get("tool_calls", ()):
            called[call["id"]] = call["function"]["name"]
        if message["role"] == "tool":
            call_id = message["tool_call_id"]
            if call_id not in called:
                raise BadRequest(f"messages[{i}] (role tool) answers tool_call_id {call_id!r}, which no earlier "
                                 "assistant message called", "messages")
            message["name"] = called[call_id]


def _fallback(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    rendered: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            block = f"{RESPONSE_OPEN}\n{message['content']}\n{RESPONSE_CLOSE}"
            if rendered and rendered[-1].get("tool_results"):  # one user turn for a run of results
                rendered[-1]["content"] += "\n" + block
            else:
                rendered.append({"role": "user", "content": block, "tool_results": True})
            continue
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            blocks = [format_call(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            message["content"] = "\n".join([message["content"], *blocks] if message["content"] else blocks)
        rendered.append(message)
    for message in rendered:
        message.pop("tool_results", None)
    if tools:
        if rendered and rendered[0]["role"] in ("system", "developer"):
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{_preamble(tools)}"}
        else:
            rendered.insert(0, {"role": "system", "content": _preamble(tools)})
    return rendered


def _preamble(tools: list[dict[str, Any]]) -> str:
    # Terse: the listing costs prompt tokens on every request that offers tools.
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False, separators=_COMPACT) for t in tools)
    return (f"Functions you may call:\n<tools>\n{listed}\n</tools>\n"
            f"Call them with one block each:\n{format_call('<name>', {'<argument>': '<value>'})}\n"
            f"Results come back in {RESPONSE_OPEN} blocks.")


# --- the output -------------------------------------------------------------


class ToolCallParser:
    """Splits one choice's output, fed as it arrives, into content and calls.

    Text that may still become a call (a partial `<tool_call>`, or a block
    waiting for its end) is held back; whitespace touching a call is dropped,
    so content streamed in pieces equals content parsed whole. A call block
    that is not a JSON object of an offered function's `name` and object
    `arguments` stays text; with parallel_tool_calls false, so does every
    block after the first call.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self._names = plan.callable_names
        self._parallel = plan.parallel
        self._pending = ""  # not judged yet
        self._space = ""  # trailing whitespace of the content: dropped if a call follows
        self._after_call = False
        self._has_content = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """The new content and the calls completed by `text`; `final` flushes what was held."""
        self._pending += text
        content: list[str] = []
        first_new = len(self.calls)
        while True:
            may_call = self._parallel or not self.calls
            start = self._pending.find(CALL_OPEN) if may_call else -1
            if start < 0:
                keep = 0 if final or not may_call else _partial_open(self._pending)
                self._text(self._pending[:len(self._pending) - keep], content)
                self._pending = self._pending[len(self._pending) - keep:]
                break
            self._text(self._pending[:start], content)
            self._pending = self._pending[start:]
            end = self._pending.find(CALL_CLOSE)
            if end < 0:
                if final:
                    self._text(self._pending, content)
                    self._pending = ""
                break
            block, self._pending = self._pending[:end + len(CALL_CLOSE)], self._pending[end + len(CALL_CLOSE):]
            call = self._call(block[len(CALL_OPEN):end])
            if call is None:
                self._text(block, content)
            else:
                self.calls.append(call)
                self._space, self._after_call = "", True
        if final:
            content.append(self._space)
            self._space = ""
        deltas = [ToolCallDelta(index=i, id=c.id, type="function",
                                function=FunctionCallDelta(name=c.function.name, arguments=c.function.arguments))
                  for i, c in enumerate(self.calls[first_new:], start=first_new)]
        return "".join(content), deltas

    def _text(self, text: str, out: list[str]) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
            if self._has_content:  # text on both sides of a call: keep them apart
                text = "\n" + text
        body = text.rstrip()
        if body:
            out.append(self._space + body)
            self._space = text[len(body):]
            self._has_content = True
        else:
            self._space += text

    def _call(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
            return None
        name, arguments = value["name"], value["arguments"]
        if name not in self._names or not isinstance(arguments, dict):
            return None
        return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                        function=FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))


def _partial_open(text: str) -> int:
    """Length of the longest end of `text` that begins CALL_OPEN (held back: a call may be starting)."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (None when it is only calls) and calls."""
    parser = ToolCallParser(plan)
    content, _ = parser.feed(text, final=True)
    return (content or None) if parser.calls else content, parser.calls
