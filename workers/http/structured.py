"""A request's structured-output constraint: OpenAI's `response_format`, vLLM's
`guided_*` fields and their newer form `structured_outputs`, as one grammar
(compiled and checked here, in prepare's thread, off the event loop)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from disagg.workers.engine.grammar import GrammarKind, build_grammar
from disagg.workers.http.errors import BadRequest
from disagg.workers.http.protocol import SamplingFields

# vLLM's `structured_outputs` keys, each the guided_* field it replaces.
_STRUCTURED_OUTPUTS: dict[str, GrammarKind] = {
    "json": GrammarKind.JSON_SCHEMA, "regex": GrammarKind.REGEX, "choice": GrammarKind.CHOICE,
    "grammar": GrammarKind.LARK,
}


@dataclass(frozen=True)
class Constraint:
    field: str  # the request field that asks for it
    kind: GrammarKind
    value: Any
    grammar: str  # llguidance's grammar text

    @property
    def json_schema(self) -> dict[str, Any] | None:
        """The schema of a JSON format (a tool grammar's text branch embeds it); None for a regex,
        choice or Lark grammar."""
        if self.kind is GrammarKind.JSON_OBJECT:
            return {"type": "object"}
        return self.value if self.kind is GrammarKind.JSON_SCHEMA else None


def structured_output(req: SamplingFields) -> Constraint | None:
    """The request's constraint, checked (400s naming the field); None if it has none."""
    given = [*_response_format(req.response_format), *_guided(req), *_structured_outputs(req.structured_outputs)]
    if not given:
        return None
    if len(given) > 1:
        raise BadRequest(f"only one structured-output constraint per request, got {', '.join(g[0] for g in given)}",
                         given[1][0])
    field, kind, value = given[0]
    if req.ignore_eos:
        raise BadRequest(f"{field} cannot be combined with ignore_eos: the output ends where the grammar does", field)
    try:
        return Constraint(field, kind, value, build_grammar(kind, value))
    except ValueError as exc:
        raise BadRequest(f"{field}: {exc}", field) from None


_Given = list[tuple[str, GrammarKind, Any]]  # (field, kind, value) of each constraint asked for


def _response_format(fmt: dict[str, Any] | None) -> _Given:
    kind = None if fmt is None else fmt.get("type")
    if fmt is None or kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", GrammarKind.JSON_OBJECT, None)]
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise BadRequest("response_format.json_schema must be an object with a `schema` object", "response_format")
        # No schema: any JSON value is allowed, as OpenAI's non-strict mode reads it.
        return [("response_format", GrammarKind.JSON_SCHEMA, spec.get("schema", {}))]
    raise BadRequest(f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format")


def _guided(req: SamplingFields) -> _Given:
    fields = (("guided_json", GrammarKind.JSON_SCHEMA, _schema(req.guided_json, "guided_json")),
              ("guided_regex", GrammarKind.REGEX, req.guided_regex),
              ("guided_choice", GrammarKind.CHOICE, req.guided_choice),
              ("guided_grammar", GrammarKind.LARK, req.guided_grammar))
    return [f for f in fields if f[2] is not None]


def _structured_outputs(value: dict[str, Any] | None) -> _Given:
    """vLLM's `structured_outputs` (its null keys, and `json_object: false`, ask for nothing)."""
    given: _Given = []
    for key, spec in (value or {}).items():
        if spec is None or (key == "json_object" and spec is False):
            continue
        if key == "json_object" and spec is True:
            given.append(("structured_outputs", GrammarKind.JSON_OBJECT, None))
        elif key in _STRUCTURED_OUTPUTS:
            if key == "json":
                spec = _schema(spec, "structured_outputs.json")
            given.append(("structured_outputs", _STRUCTURED_OUTPUTS[key], spec))
        else:
            raise BadRequest(f"structured_outputs.{key} is not supported: only json, regex, choice, grammar and "
                             "json_object", "structured_outputs")
    return given


def _schema(value: Any, where: str) -> Any:
    """A JSON schema given as an object or (vLLM allows it) as JSON text."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise BadRequest(f"{where} is not JSON: {exc}", where.split(".")[0]) from None
