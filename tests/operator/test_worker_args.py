"""Every argument list the operator can give a worker is one the worker's own `disagg serve` accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from disagg.operator import manifests
from disagg.operator.spec import FIELDS, ROLES, Field, parse_spec
from disagg.workers.args import build_configs
from disagg.workers.cli import build_parser
from disagg.workers.security.key import ClusterKey

BASE: dict[str, Any] = {"model": {"source": "builtin:smollm2-135m"}}


def values(f: Field) -> list[Any]:
    """The values that can reach a worker: each choice, else each bound, else a sample string."""
    if f.kind is bool:
        return [False, True]
    if f.choices:
        return list(f.choices)
    if f.bounds is not None:
        return list(f.bounds)
    return ["some-org/some-model"]


def spec_with(f: Field, role: str, value: Any) -> dict[str, Any]:
    spec = {**BASE, "model": dict(BASE["model"])}
    section = role if f.section == "role" else f.section
    if section:
        spec[section] = {**spec.get(section, {}), f.name: value}
    else:
        spec[f.name] = value
    return spec


CASES = [({**BASE}, role, None) for role in ROLES] + [
    (spec_with(f, role, value), role, f) for f in FIELDS if f.flag for role in ROLES for value in values(f)
]


@pytest.mark.parametrize("spec, role, field", CASES,
                         ids=[f"{r}-{f.name if f else 'defaults'}-{i}" for i, (_, r, f) in enumerate(CASES)])
def test_disagg_serve_parses_the_operators_arguments(spec: dict[str, Any], role: str, field: Field | None,
                                                     tmp_path: Path) -> None:
    # The mounted cluster key, here a file of our own.
    key_file = tmp_path / manifests.KEY_ITEM
    ClusterKey.generate().write(key_file)
    args = [a.replace("$(POD_IP)", "10.0.0.7").replace(manifests.KEY_MOUNT_DIR, str(tmp_path))
            for a in manifests.worker_args(role, parse_spec(spec))]
    namespace = build_parser("serve").parse_args(["serve", *args])
    engine, server = build_configs(namespace)  # the configs validate: a ValueError fails the test
    assert server.role.value == role and server.instance_name == "10.0.0.7:7777"
    assert engine.model == spec["model"]["source"]
    for f in FIELDS:
        if f.flag is None:
            continue
        dest = f.flag.removeprefix("--").replace("-", "_")
        section = role if f.section == "role" else f.section
        given = (spec.get(section, {}) if section else spec).get(f.name, f.default)
        if f is field or given is not None:
            assert str(getattr(namespace, dest)) == str(given), f"{f.flag}: {getattr(namespace, dest)!r} != {given!r}"


def test_every_flag_of_the_table_is_a_disagg_serve_flag() -> None:
    parser = build_parser("serve")
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]  # type: ignore[union-attr]
    known = {s for a in serve._actions for s in a.option_strings}
    assert {f.flag for f in FIELDS if f.flag} <= known
