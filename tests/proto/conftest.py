"""Helpers shared by the wire-contract tests."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

LABELS = {1: "optional", 2: "required", 3: "repeated"}
TYPES = {v: k[len("TYPE_"):].lower() for k, v in descriptor_pb2.FieldDescriptorProto.Type.items()}


def wire_listing(files: Iterable[descriptor_pb2.FileDescriptorProto]) -> list[str]:
    """Everything that decides wire identity, one sorted line per item.

    Paths, comments and options are left out: they do not travel.
    """
    lines: list[str] = []

    def visit(prefix: str, msg: descriptor_pb2.DescriptorProto) -> None:
        name = f"{prefix}.{msg.name}"
        lines.append(f"message {name}")
        for f in msg.field:
            label = LABELS[f.label]
            if f.proto3_optional:
                label = "proto3_optional"
            type_name = f" {f.type_name.lstrip('.')}" if f.type_name else ""
            lines.append(f"field {name}.{f.name} = {f.number} {label} {TYPES[f.type]}{type_name}")
        for nested in msg.nested_type:
            if not nested.options.map_entry:
                visit(name, nested)

    for fd in files:
        for msg in fd.message_type:
            visit(fd.package, msg)
        for enum in fd.enum_type:
            for v in enum.value:
                lines.append(f"enum {fd.package}.{enum.name}.{v.name} = {v.number}")
        for svc in fd.service:
            for m in svc.method:
                stream = f"{'stream ' if m.client_streaming else ''}{m.input_type.lstrip('.')}"
                out = f"{'stream ' if m.server_streaming else ''}{m.output_type.lstrip('.')}"
                lines.append(f"rpc /{fd.package}.{svc.name}/{m.name}({stream}) returns ({out})")
    return sorted(lines)


@pytest.fixture
def listing() -> Callable[[Iterable[descriptor_pb2.FileDescriptorProto]], list[str]]:
    return wire_listing


@pytest.fixture
def golden_path() -> Path:
    return Path(__file__).with_name("golden_wire.txt")
