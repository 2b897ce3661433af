"""The start check of `gateway serve`: every message it decodes has the fields it reads, or
it refuses to start with the fix. The shadowed case is built as a descriptor: the OTLP 0.x
logs messages xds-protos installs at opentelemetry-proto's paths."""

from __future__ import annotations

import sys
import types

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from gateway import cli
from gateway.server import proto_fields
from gateway.server.proto_fields import Needs

F = descriptor_pb2.FieldDescriptorProto
OTLP_NEEDS = next(n for n in proto_fields.NEEDS if n.message == "ExportLogsServiceRequest")


def _module(name: str, messages: dict[str, list[tuple[str, int, str]]]) -> types.ModuleType:
    """A generated-like module: `messages` maps a name to its (field, number, message type
    or '' for a string) list."""
    fdp = descriptor_pb2.FileDescriptorProto(name=f"{name}.proto", package=name,
                                             syntax="proto3")
    for msg, fields in messages.items():
        m = fdp.message_type.add(name=msg)
        for field, number, kind in fields:
            m.field.add(name=field, number=number, label=F.LABEL_REPEATED if kind else
                        F.LABEL_OPTIONAL, type=F.TYPE_MESSAGE if kind else F.TYPE_STRING,
                        type_name=f".{name}.{kind}" if kind else None)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    module = types.ModuleType(name)
    for msg in messages:
        setattr(module, msg, message_factory.GetMessageClass(
            pool.FindMessageTypeByName(f"{name}.{msg}")))
    return module


OTLP_0X = {  # what the 0.x copy calls them: same wire numbers, other names
    "ExportLogsServiceRequest": [("resource_logs", 1, "ResourceLogs")],
    "ResourceLogs": [("instrumentation_library_logs", 2, "InstrumentationLibraryLogs")],
    "InstrumentationLibraryLogs": [("logs", 2, "LogRecord")],
    "LogRecord": [("attributes", 6, "KeyValue")],
    "KeyValue": [("key", 1, "")],
}


@pytest.fixture
def shadowed(monkeypatch: pytest.MonkeyPatch) -> Needs:
    monkeypatch.setitem(sys.modules, "shadowed_logs_pb2", _module("shadowed_logs_pb2", OTLP_0X))
    return Needs("shadowed_logs_pb2", "ExportLogsServiceRequest", OTLP_NEEDS.paths,
                 "xds-protos")


def test_the_installed_messages_have_every_field_the_sidecar_reads() -> None:
    assert proto_fields.problems() == []


def test_a_message_lacking_a_field_is_named_with_its_fix(shadowed: Needs) -> None:
    [line] = proto_fields.problems([shadowed])
    assert "shadowed_logs_pb2.ExportLogsServiceRequest" in line
    assert "lacks resource_logs=1.scope_logs=2;" in line  # once, for both paths through it
    assert "pip install --force-reinstall --no-deps 'xds-protos==1.85.0'" in line


def test_a_field_with_another_number_is_a_problem_too() -> None:
    msg = _module("renumbered_pb2", {"KeyValue": [("key", 3, "")]}).KeyValue.DESCRIPTOR
    assert proto_fields.missing(msg, ["key=1", "key", "value"]) == ["key=1 (is field 3)", "value"]


def test_a_module_that_cannot_load_is_named_with_its_fix() -> None:
    [line] = proto_fields.problems([Needs("no_such_module_pb2", "M", ("x",), "xds-protos")])
    assert "cannot load" in line and "xds-protos==1.85.0" in line


def test_serve_refuses_to_start_with_the_fix(shadowed: Needs, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(proto_fields, "NEEDS", (shadowed,))
    monkeypatch.setattr(cli, "_settings", lambda args: pytest.fail("got past the check"))
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve"])
    assert "gateway serve cannot start" in str(exited.value.code)
    assert "force-reinstall --no-deps 'xds-protos==1.85.0'" in str(exited.value.code)
