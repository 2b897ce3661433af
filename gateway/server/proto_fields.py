"""The protobuf fields the sidecar reads and writes, checked before `gateway serve` serves.

Generated modules can be overwritten by another distribution that ships files at the same
paths (xds-protos ships an OTLP 0.x `opentelemetry.proto`; pip lets the last install win).
A message lacking a field we read would fail every request of its kind at run time, or,
as Envoy's records did, silently; so the sidecar refuses to start instead, naming the
module, the missing fields and the reinstall that fixes it. The check walks descriptors
only: a few milliseconds, once.

A path is dotted field names through nested messages; `name=N` also pins the field number,
where bytes are written by hand (`check_wire`).
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata

from google.protobuf.descriptor import Descriptor

HAND_WRITTEN = "gateway._proto (our own: run `make protos` in a checkout, or reinstall gateway)"


@dataclass(frozen=True)
class Needs:
    module: str  # the generated module, e.g. envoy.service.auth.v3.external_auth_pb2
    message: str  # a top-level message of it
    paths: tuple[str, ...]
    distribution: str  # who ships the module: the fix is to reinstall it


def missing(message: Descriptor, paths: Iterable[str]) -> list[str]:
    """The paths (or their first absent step, or a wrong field number) `message` lacks."""
    out: list[str] = []
    for path in paths:
        d: Descriptor | None = message
        for i, step in enumerate(path.split(".")):
            name, _, number = step.partition("=")
            field = d.fields_by_name.get(name) if d is not None else None
            if field is None or (number and field.number != int(number)):
                got = f" (is field {field.number})" if field is not None else ""
                out.append(".".join(path.split(".")[:i + 1]) + got)
                break
            d = field.message_type
    return list(dict.fromkeys(out))  # paths sharing a missing step name it once


_BODY = ("body", "end_of_stream")
_HEADER_OPTION = ("header.key", "header.value", "header.raw_value", "append_action")
NEEDS: tuple[Needs, ...] = (
    Needs("envoy.service.auth.v3.external_auth_pb2", "CheckRequest", (
        "attributes.request.http.headers", "attributes.request.http.method",
        "attributes.request.http.path", "attributes.request.http.raw_body"), "xds-protos"),
    Needs("envoy.service.auth.v3.external_auth_pb2", "CheckResponse", (
        "status=1", "denied_response.status.code", "dynamic_metadata=4",
        *(f"denied_response.headers.{h}" for h in _HEADER_OPTION), "denied_response.body",
        # check_wire writes the allowed answer by field number
        "ok_response=3.headers=2.header=1.key=1", "ok_response=3.headers=2.header=1.value=2",
        "ok_response=3.headers=2.append_action=3", "ok_response=3.headers_to_remove=5",
        "ok_response=3.response_headers_to_add=6"), "xds-protos"),
    Needs("envoy.service.ext_proc.v3.external_processor_pb2", "ProcessingRequest", (
        "attributes", "metadata_context.filter_metadata", "request_headers",
        "request_trailers", "response_trailers",
        *(f"request_body.{f}" for f in _BODY), *(f"response_body.{f}" for f in _BODY),
        "response_headers.end_of_stream", "response_headers.headers.headers.key",
        "response_headers.headers.headers.value", "response_headers.headers.headers.raw_value",
    ), "xds-protos"),
    Needs("envoy.service.ext_proc.v3.external_processor_pb2", "ProcessingResponse", (
        "request_headers", "request_trailers", "response_headers", "response_trailers",
        "request_body.response.body_mutation.body",
        *(f"request_body.response.header_mutation.set_headers.{h}" for h in _HEADER_OPTION),
        "response_body.response.body_mutation.streamed_response.body",
        "response_body.response.body_mutation.streamed_response.end_of_stream",
    ), "xds-protos"),
    # the Check's gRPC status; googleapis-common-protos ships these paths too
    Needs("google.rpc.status_pb2", "Status", ("code=1",), "xds-protos"),
    Needs("gateway._proto.gateway.otlp.v1.otlp_pb2", "ExportLogsServiceRequest", (
        "resource_logs=1.scope_logs=2.log_records=2.attributes=6.key=1",
        "resource_logs=1.scope_logs=2.log_records=2.attributes=6.value=2.string_value=1",
    ), HAND_WRITTEN),
)


def _fix(distribution: str) -> str:
    if distribution == HAND_WRITTEN:
        return distribution
    pin = distribution
    with contextlib.suppress(metadata.PackageNotFoundError):  # the version gateway asks for
        pin = next((r.split(";")[0].replace(" ", "") for r in metadata.requires("gateway") or ()
                    if re.match(rf"{re.escape(distribution)}\s*[=<>~!]", r)), pin)
    return f"pip install --force-reinstall --no-deps '{pin}'"


def problems(needs: Iterable[Needs] = NEEDS) -> list[str]:
    """One line per message that cannot be used, each with its fix; [] when all is well."""
    out: list[str] = []
    for n in needs:
        where = f"{n.module}.{n.message}"
        try:
            module = importlib.import_module(n.module)
            gone = missing(getattr(module, n.message).DESCRIPTOR, n.paths)
        except (ImportError, AttributeError, TypeError) as exc:
            out.append(f"{where} cannot load ({exc}); fix: {_fix(n.distribution)}")
            continue
        if gone:
            origin = getattr(module, "__file__", "?")
            out.append(f"{where} (from {origin}) lacks {', '.join(gone)}; another "
                       f"distribution may have overwritten it. Fix: {_fix(n.distribution)}")
    return out


def check_or_exit(needs: Iterable[Needs] | None = None) -> None:
    """Refuse to start (exit status 1, the reasons and fixes on stderr) if a message the
    sidecar reads lacks a field."""
    found = problems(NEEDS if needs is None else needs)
    if found:
        raise SystemExit("gateway serve cannot start: messages it decodes lack fields they "
                         "need\n  " + "\n  ".join(found))
