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
  asks for `strict` arguments or the answer has a JSON format):
  `ToolPlan.grammar` allows exactly the call blocks (after text, in `auto`;
  instead of the JSON answer, with a format), with arguments valid under the
  declared schema; it rides `SamplingParams.grammar`, so PD carries it as any
  structured output.
- The output (every mode but `none`) is split into content and calls by
  tool_parser.py, while streaming too.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from disagg.workers.engine.grammar import GrammarKind, build_grammar, lark_json
from disagg.workers.http.errors import BadRequest
from disagg.workers.http.protocol import ChatCompletionRequest, ToolCall, ToolSpec
from disagg.workers.http.structured import Constraint

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
_COMPACT = (",", ":")  # the separators the grammar's JSON uses; history is written the same way


class ToolChoice(StrEnum):
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
    json_answer: bool = False  # the request gives the answer a JSON format (response_format, guided_json)

    @property
    def offered(self) -> bool:
        """Whether the model is shown the tools and its output parsed for calls."""
        return self.choice is not ToolChoice.NONE

    @property
    def enforced(self) -> bool:
        """Whether the call format is enforced by a grammar: `required`, a named
        function, or `auto` with a function that asks for `strict` arguments or
        with a JSON answer (else the answer's format would leave no room for calls)."""
        auto = self.choice is ToolChoice.AUTO and (self.json_answer or any(t.function.strict for t in self.tools))
        return auto or self.calls_only

    @property
    def calls_only(self) -> bool:
        """Whether the output is nothing but calls (`required` or a named function)."""
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)

    @property
    def callable_names(self) -> frozenset[str]:
        return frozenset([self.named] if self.named else (t.function.name for t in self.tools))

    def specs(self) -> list[dict[str, Any]]:
        """The tools as OpenAI writes them (what chat templates expect)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]


def plan_tools(req: ChatCompletionRequest, constraint: Constraint | None = None) -> ToolPlan | None:
    """The request's tool plan, checked (400s naming `tools` or `tool_choice`);
    None when it offers no tools. An enforced plan's grammar holds the request's
    structured-output `constraint`, which must be a JSON format."""
    tools = tuple(req.tools or ())
    _check_tools(tools)
    choice, named = _tool_choice(req.tool_choice, tools)
    if not tools:
        return None
    text_schema = None if constraint is None else constraint.json_schema
    plan = ToolPlan(tools, choice, req.parallel_tool_calls, named, json_answer=text_schema is not None)
    if not plan.enforced:
        return plan
    if req.ignore_eos:
        raise BadRequest("tool_choice required, a named function or strict tools cannot be combined with "
                         "ignore_eos: the output ends where the enforced call format does", "tool_choice")
    if constraint is not None and text_schema is None:
        raise BadRequest(f"{constraint.field} cannot be combined with tool_choice required, a named function or "
                         "strict tools: only a JSON format (response_format, guided_json) can", "tool_choice")
    return dataclasses.replace(plan, grammar=_call_grammar(plan, text_schema))


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


def _call_grammar(plan: ToolPlan, text_schema: dict[str, Any] | None) -> str:
    """Lark: the call blocks, each a call of one callable function with
    arguments valid under its schema; one block (named, or parallel_tool_calls
    false) or blocks separated by newlines. In `auto`, text (which never holds
    a call's start) may stand alone or come before the blocks; with a
    `text_schema` (the request's JSON format) the output is either that JSON
    or the blocks. `required` and named calls leave no text to format."""
    lines = []
    specs = [t for t in plan.tools if t.function.name in plan.callable_names]
    tail = json.dumps(f"}}\n{CALL_CLOSE}")
    for i, tool in enumerate(specs):
        head = json.dumps(f'\n{{"name":{json.dumps(tool.function.name)},"arguments":')
        lines.append(f"body_{i}: {head} args_{i} {tail}")
        lines.append(f"args_{i}: {lark_json(tool.function.parameters or _NO_ARGUMENTS)}")
    separator = json.dumps("\n" + CALL_OPEN)
    more = f"({separator} body)*" if plan.named is None and plan.parallel else ""
    if plan.choice is ToolChoice.AUTO and text_schema is not None:
        start = [f"start: answer | {json.dumps(CALL_OPEN)} body {more}", f"answer: {lark_json(text_schema)}"]
    elif plan.choice is ToolChoice.AUTO:
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


def history_calls(index: int, calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """An assistant message's calls in Hugging Face's form (arguments as an object)."""
    rendered = []
    for call in calls:
        try:
            # "" is how some clients and servers (vLLM's streams) write a call without arguments.
            arguments = json.loads(call.function.arguments or "{}")
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
