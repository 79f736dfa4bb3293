"""Tool calls out of a chat model's output, whole or as it streams: the
blocks of tools.py's call format that name an offered function become calls;
everything else stays text (docs/openai-api.md, "Tool calling")."""

from __future__ import annotations

import json
import re
import uuid

from disagg.workers.http.protocol import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta
from disagg.workers.http.tools import CALL_CLOSE, CALL_OPEN, ToolPlan

# The start of an enforced block's body: the function's name, whole when its closing quote came.
_CUT_NAME = re.compile(r'\s*\{"name":"([A-Za-z0-9_-]*)(")?')
_DECODER = json.JSONDecoder()


class ToolCallParser:
    """Splits one choice's output, fed as it arrives, into content and calls.

    Text that may still become a call (a partial `<tool_call>`, or a block
    waiting for its end) is held back; whitespace touching a call is dropped,
    so content streamed in pieces equals content parsed whole. A call block
    that is not a JSON object of an offered function's `name` and object
    `arguments` stays text; with parallel_tool_calls false, so does every
    block after the first call. Where a grammar enforces the format, a block
    cut short (by max_tokens) is a call with its arguments as far as written,
    and a cut `<tool_call>` of a calls-only output is dropped: both are the
    format's markup, never the model's text.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self._names = plan.callable_names
        self._parallel = plan.parallel
        self._enforced = plan.enforced
        self._calls_only = plan.calls_only
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
                if final and self._calls_only:
                    self._pending = self._pending[:len(self._pending) - _partial_open(self._pending)]
                keep = 0 if final or not may_call else _partial_open(self._pending)
                self._text(self._pending[:len(self._pending) - keep], content)
                self._pending = self._pending[len(self._pending) - keep:]
                break
            self._text(self._pending[:start], content)
            self._pending = self._pending[start:]
            end = self._pending.find(CALL_CLOSE)
            if end < 0:
                if final:
                    self._flush_open_block(content)
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

    def _flush_open_block(self, out: list[str]) -> None:
        """The output ended inside a block: under an enforced format, a call cut short; else text."""
        if not self._enforced:
            self._text(self._pending, out)
        elif (cut := self._cut_call(self._pending[len(CALL_OPEN):])) is not None:
            self.calls.append(cut)
        self._pending = ""

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
        return _new_call(name, json.dumps(arguments, ensure_ascii=False))

    def _cut_call(self, body: str) -> ToolCall | None:
        """A block of the enforced format (`{"name":"N","arguments":...`) cut short: a call of
        the one function its name (or the start of it) can be, arguments as written so far."""
        head = _CUT_NAME.match(body)
        if head is None:
            return None
        name, closed = head.group(1), head.group(2)
        names = [n for n in self._names if n == name or (not closed and n.startswith(name))]
        if len(names) != 1:
            return None
        written = body.partition('"arguments":')[2].lstrip()
        try:
            _, end = _DECODER.raw_decode(written)
        except ValueError:  # cut inside the arguments
            return _new_call(names[0], written)
        return _new_call(names[0], written[:end])  # whole: what follows is the block's own markup


def _new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=arguments))


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
