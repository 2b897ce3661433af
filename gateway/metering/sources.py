"""The two metering sources (docs/request-flow.md "Two metering sources") as what each one
means, so the sidecar, the Envoy config and the dev stack read one answer instead of
comparing a name.

`GATEWAY_METERING` / `--metering` stay the names users set (gateway/settings.py);
`source_named` turns one into its source.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeteringSource:
    """Who does the per-chunk work of metering, and what that asks of the sidecar and Envoy."""

    name: str  # the setting's value: GATEWAY_METERING, --metering
    # The sidecar. Defaults of GATEWAY_CONCURRENCY_GRACE_MS and GATEWAY_ORPHAN_GRACE_MS: a
    # request's end reaches the sidecar after the client saw it (its record: ~50 ms), and its
    # record may come long after its lease (Envoy retries a batch for ~36 s).
    concurrency_grace_s: float
    orphan_grace_s: float
    # No stream in the sidecar renews an admission's lease: it is renewed while Envoy's
    # heartbeat records say the request lives, until its end.
    watches: bool
    # Envoy sends a record of every request and the records service emits it as the request's
    # event. Else Envoy sends records of early-ended streams only: who cut a stream.
    records_are_events: bool
    # Envoy (gateway/envoyconf/bootstrap.py)
    heartbeat: bool  # a record of each request in flight every heartbeat
    lua_filters: bool  # Envoy's Lua and json_to_metadata filters meter; the usage metadata theirs
    ext_proc_filter: bool  # ext_proc streams each request to the sidecar
    # Runs on any Envoy with ext_authz and ext_proc: a managed gateway, whose Check is gRPC.
    # Else it needs an Envoy where you add http filters and an access logger.
    portable: bool


ENVOY = MeteringSource(
    name="envoy",
    concurrency_grace_s=0.1,
    orphan_grace_s=45.0,
    watches=True,
    records_are_events=True,
    heartbeat=True,
    lua_filters=True,
    ext_proc_filter=False,
    portable=False,
)
EXT_PROC = MeteringSource(
    name="ext_proc",
    concurrency_grace_s=0.0,
    orphan_grace_s=0.0,
    watches=False,
    records_are_events=False,
    heartbeat=False,
    lua_filters=False,
    ext_proc_filter=True,
    portable=True,
)
SOURCES: dict[str, MeteringSource] = {s.name: s for s in (ENVOY, EXT_PROC)}


def source_named(name: str) -> MeteringSource:
    """The source a GATEWAY_METERING / --metering value names."""
    try:
        return SOURCES[name]
    except KeyError:
        raise ValueError(f"metering: {name!r} is not one of {', '.join(SOURCES)}") from None
