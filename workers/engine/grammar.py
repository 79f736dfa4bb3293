"""Constrained decoding (structured outputs), with the grammar library behind
this one module: llguidance (MIT; docs/openai-api.md says why).

A request's constraint travels as llguidance's grammar text (`SamplingParams.grammar`),
which `build_grammar` makes from the API's forms (a JSON schema, any JSON
object, a regex, a list of choices, a Lark grammar) and checks. The engine
keeps one compiled matcher per distinct grammar (`Grammars`, an LRU) and gives
each request a copy, which the request advances with every token it appends;
the sampler masks a constrained row's logits to the tokens the matcher allows.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from enum import Enum
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np
import torch

if TYPE_CHECKING:
    from disagg.workers.engine.tokenizer import Tokenizer

Matcher = llguidance.LLMatcher
GRAMMAR_CACHE_SIZE = 64
# Compact JSON: no free whitespace, so a model cannot pad its output with blanks forever.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


class GrammarKind(str, Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    LARK = "lark"


# Where a schema keeps the subschemas that shape its values: one, a list, or a map of names
# to them. Conditions (`not`, `if`, `contains`, ...) are left as written.
_ONE_SUBSCHEMA = ("additionalProperties", "items", "additionalItems", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def closed_objects(schema: Any, closable: bool = True) -> Any:
    """A copy of `schema` where each object that lists `properties` and says nothing of
    others (`additionalProperties`, `unevaluatedProperties`) allows only those, as
    xgrammar (in its default strict mode) and llama.cpp read a schema: a model asked
    for {name, age} should not add keys of its own. An object that also takes `allOf`
    or `$ref`, or is itself a branch of an `allOf`, is left open: closing it would
    refuse the properties its siblings add."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE_SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub, closable=key != "allOf") for sub in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    says_nothing = "additionalProperties" not in out and "unevaluatedProperties" not in out
    if closable and says_nothing and isinstance(out.get("properties"), dict) and not {"allOf", "$ref"} & out.keys():
        out["additionalProperties"] = False
    return out


def build_grammar(kind: GrammarKind, value: Any) -> str:
    """llguidance's grammar text for one constraint; ValueError saying what is wrong."""
    if kind is GrammarKind.JSON_SCHEMA:
        if not isinstance(value, dict):
            raise ValueError("the JSON schema must be an object")
        grammar = Matcher.grammar_from_json_schema(closed_objects(value), defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
    elif kind is GrammarKind.JSON_OBJECT:
        grammar = Matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
    elif kind is GrammarKind.REGEX:
        if not isinstance(value, str) or not value:
            raise ValueError("the regex must be a non-empty string")
        grammar = Matcher.grammar_from_regex(value)
    elif kind is GrammarKind.CHOICE:
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("the choices must be a non-empty list of non-empty strings")
        # Lark string literals take JSON's escapes.
        grammar = Matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    else:
        if not isinstance(value, str) or not value.strip():
            raise ValueError("the grammar must be a non-empty Lark grammar")
        grammar = Matcher.grammar_from_lark(value)
    check_grammar(grammar)
    return grammar


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark rule body that matches compact JSON valid under `schema`
    (llguidance's `%json` extension), for grammars that embed JSON."""
    return "%json " + json.dumps({"x-guidance": _JSON_OPTIONS, **closed_objects(schema)})


def check_grammar(grammar: str) -> None:
    """ValueError with llguidance's message when the grammar text does not compile."""
    error = Matcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(error.strip())


class Grammars:
    """Matchers for one tokenizer and logits width: each distinct grammar is
    compiled once (bounded LRU) and copied per request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, capacity: int = GRAMMAR_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._capacity = capacity
        self._compiled: OrderedDict[str, Matcher] = OrderedDict()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built on first use
        # What a matcher in error allows: llguidance's own end token is the tokenizer's eos.
        self._eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0

    def constraint(self, grammar: str) -> Constraint:
        """A request's constraint at the grammar's start; ValueError if it does not compile."""
        compiled = self._compiled.get(grammar)
        if compiled is None:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._tokenizer.hf, n_vocab=self.vocab_size)  # type: ignore[arg-type]
            compiled = Matcher(self._ll_tokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise ValueError(f"the grammar does not compile: {compiled.get_error()}")
            self._compiled[grammar] = compiled
            if len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return Constraint(compiled.deep_copy(), self.vocab_size, self._eos_token_id)


class Constraint:
    """One request's grammar state: advanced by each token it appends."""

    def __init__(self, matcher: Matcher, vocab_size: int, eos_token_id: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos_token_id = eos_token_id

    def advance(self, token_id: int) -> None:
        # A refused token puts the matcher in its error state, which allowed() handles.
        self._matcher.consume_token(token_id)

    def allowed(self) -> torch.Tensor:
        """[V] bool on the CPU: the tokens the grammar accepts next. A matcher in
        error (a token it refused was appended) allows only the end of the sequence."""
        if self._matcher.is_error():
            allowed = torch.zeros(self._vocab_size, dtype=torch.bool)
            allowed[self._eos_token_id] = True
            return allowed
        # Words of 32 bits, little-endian, bit i of word j = token 32 j + i.
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self._vocab_size].astype(np.bool_))
