"""tools.py without a server: the enforced call grammar (what each
`tool_choice` lets a model write, through the engine's own `Grammars`), and
the parser (streamed in any pieces, it says what it says on the whole text).
"""

from __future__ import annotations

from typing import Any

import pytest

from disagg.testing.tiny_model import build_tokenizer
from disagg.workers.engine.grammar import Grammars
from disagg.workers.engine.tokenizer import Tokenizer
from disagg.workers.http.protocol import ChatCompletionRequest, ToolCallDelta
from disagg.workers.http.structured import structured_output
from disagg.workers.http.tool_parser import ToolCallParser, parse_output
from disagg.workers.http.tools import ToolPlan, format_call, plan_tools

ADD: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
                               {"type": "function", "function": {"name": "ping"}}]
ADD_CALL = format_call("add", {"a": 1, "b": 2})
PING_CALL = format_call("ping", {})


def _plan(**fields: Any) -> ToolPlan:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **fields}
    plan = plan_tools(ChatCompletionRequest.model_validate(body))
    assert plan is not None
    return plan


class Checker:
    """Whether a model may write exactly a text and then end, under a plan's grammar."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.grammars = Grammars(tokenizer, tokenizer.vocab_size)

    def accepts(self, plan: ToolPlan, text: str) -> bool:
        assert plan.grammar is not None
        constraint = self.grammars.constraint(plan.grammar)
        for token in self.tokenizer.encode(text, add_special_tokens=False):
            if not constraint.allowed()[token]:
                return False
            constraint.advance(token)
        return bool(constraint.allowed()[self.tokenizer.eos_token_ids[0]])


@pytest.fixture(scope="module")
def grammars(tmp_path_factory: pytest.TempPathFactory) -> Checker:
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    return Checker(Tokenizer.from_dir(folder))


def test_required_allows_only_calls_with_valid_arguments(grammars: Checker) -> None:
    plan = _plan(tool_choice="required")
    assert grammars.accepts(plan, ADD_CALL)
    assert grammars.accepts(plan, f"{ADD_CALL}\n{PING_CALL}")
    assert not grammars.accepts(plan, "Hello")
    assert not grammars.accepts(plan, format_call("add", {"a": 1}))  # b is required
    assert not grammars.accepts(plan, format_call("add", {"a": "1", "b": 2}))  # a is an integer
    assert not grammars.accepts(plan, format_call("nope", {}))
    single = _plan(tool_choice="required", parallel_tool_calls=False)
    assert grammars.accepts(single, PING_CALL) and not grammars.accepts(single, f"{ADD_CALL}\n{PING_CALL}")


def test_a_named_function_allows_one_call_of_it(grammars: Checker) -> None:
    plan = _plan(tool_choice={"type": "function", "function": {"name": "ping"}})
    assert grammars.accepts(plan, PING_CALL)
    assert not grammars.accepts(plan, ADD_CALL) and not grammars.accepts(plan, f"{PING_CALL}\n{PING_CALL}")


def test_auto_is_enforced_only_with_a_strict_function(grammars: Checker) -> None:
    assert _plan().grammar is None and _plan(tool_choice="none").grammar is None
    strict = [{"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}}]
    plan = _plan(tools=strict)
    assert grammars.accepts(plan, "Just text, <tool not a call.")
    assert grammars.accepts(plan, f"Adding.\n{ADD_CALL}") and grammars.accepts(plan, ADD_CALL)
    assert not grammars.accepts(plan, f"Adding.\n{format_call('add', {'a': 1})}")
    assert not grammars.accepts(plan, "Adding <tool_call> by hand")


def _answer_or_calls_plan(tools: list[dict[str, Any]]) -> ToolPlan:
    answer = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
            "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": answer}}}
    req = ChatCompletionRequest.model_validate(body)
    plan = plan_tools(req, structured_output(req))
    assert plan is not None
    return plan


@pytest.mark.parametrize("strict", [True, False])
def test_auto_with_a_json_format_is_the_answer_or_calls(grammars: Checker, strict: bool) -> None:
    """Strict or not, tools offered in `auto` beside a JSON answer format leave the model both
    choices (before, plain tools got the format on the whole output and could never be called)."""
    plan = _answer_or_calls_plan([{"type": "function", "function": {"name": "add", "parameters": ADD,
                                                                     "strict": strict}}])
    assert grammars.accepts(plan, '{"sum":3}') and grammars.accepts(plan, ADD_CALL)
    assert not grammars.accepts(plan, "Just text") and not grammars.accepts(plan, '{"total":3}')
    assert not grammars.accepts(plan, f'{{"sum":3}}\n{ADD_CALL}') and not grammars.accepts(plan, f"Adding.\n{ADD_CALL}")


SPLIT_CASES = [
    f"Sure, adding.\n{ADD_CALL}\n{PING_CALL}\n",
    f"  {ADD_CALL}",
    "text <tool_call> unfinished",
    f"a<tool_cal b {format_call('nope', {})} c {PING_CALL} d <",
    "plain text with trailing space \n",
]


@pytest.mark.parametrize("text", SPLIT_CASES)
@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_pieces_parse_as_the_whole_text(text: str, parallel: bool) -> None:
    plan = _plan(parallel_tool_calls=parallel)
    content, calls = parse_output(plan, text)
    for size in (1, 2, 3, 7):
        parser = ToolCallParser(plan)
        streamed, deltas = "", list[ToolCallDelta]()
        for i in range(0, len(text), size):
            piece, new = parser.feed(text[i:i + size], final=i + size >= len(text))
            streamed, deltas = streamed + piece, deltas + new
        assert (streamed or None) == (content or None)
        assert [(d.index, d.function.name, d.function.arguments) for d in deltas if d.function] == \
               [(i, c.function.name, c.function.arguments) for i, c in enumerate(calls)]


def test_the_parser_reads_calls_keeps_the_rest_as_text() -> None:
    content, calls = parse_output(_plan(), SPLIT_CASES[0])
    assert content == "Sure, adding." and [c.function.name for c in calls] == ["add", "ping"]
    assert calls[0].function.arguments == '{"a": 1, "b": 2}' and calls[0].id.startswith("call_")
    content, calls = parse_output(_plan(), SPLIT_CASES[3])
    assert content == f"a<tool_cal b {format_call('nope', {})} c\nd <" and [c.function.name for c in calls] == ["ping"]
    content, calls = parse_output(_plan(parallel_tool_calls=False), SPLIT_CASES[0])
    assert content == f"Sure, adding.\n{PING_CALL}\n" and len(calls) == 1  # text keeps its own whitespace
    assert parse_output(_plan(), SPLIT_CASES[4]) == (SPLIT_CASES[4], [])  # no call: the text as written
    assert parse_output(_plan(), f" {ADD_CALL} ")[0] is None  # only calls: no content


def test_a_call_cut_short_carries_its_arguments_as_written_and_never_the_blocks_markup() -> None:
    """Cut by max_tokens anywhere in an enforced block: the arguments so far (a prefix of the
    JSON written), and once they are whole, exactly them, not the closing brace or tag after them."""
    plan = _plan(tool_choice="required")
    written = '{"a":1,"b":2}'
    for cut in range(ADD_CALL.index(written) + 1, len(ADD_CALL)):
        _, [call] = parse_output(plan, ADD_CALL[:cut])
        arguments = call.function.arguments
        assert call.function.name == "add" and written.startswith(arguments), (cut, arguments)
        if cut >= ADD_CALL.index(written) + len(written):
            assert arguments == written, (cut, arguments)

