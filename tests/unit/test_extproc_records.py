"""With the ext_proc source Envoy sends the sidecar two kinds of record: a stream that
ended early (who ended it: the recorder is told, ext_proc emits the event), and a request
whose Check failed (the only word of it there is: its `denied` event is made from it). Told
apart by the Check's metadata and Envoy's response code details, so that a record of a
request ext_proc metered is never made a second event."""

from __future__ import annotations

from pathlib import Path

import orjson

from gateway import envoy_contract as c
from gateway.clock import SystemClock
from gateway.limits.ledger import Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.metering.recorder import Recorder
from gateway.server.records_service import RecordsService
from gateway.sinks.spool import Spool


def _service(tmp_path: Path) -> tuple[RecordsService, Spool]:
    spool = Spool(tmp_path, "i").open()
    ledger = Ledger(MemoryLimiter(), SystemClock(), 30.0)
    return RecordsService(Recorder(spool, "s", ledger), ledger, emits=False), spool


def _record(rid: str, flags: str, details: str, authz: str = "-") -> dict[str, str]:
    return {c.REC_ID: rid, c.REC_TYPE: "DownstreamEnd", c.REC_PATH: "/v1/chat/completions",
            c.REC_CODE: "503" if details == c.AUTHZ_ERROR_DETAILS else "200",
            c.REC_FLAGS: flags, c.REC_DETAILS: details, c.REC_START: "1796611890.418420",
            c.REC_DURATION_US: "1200", c.REC_AUTHZ: authz}


def test_a_failed_checks_record_is_its_event_and_a_cut_streams_only_a_word(
        tmp_path: Path) -> None:
    service, spool = _service(tmp_path)
    checked = orjson.dumps({"key_id": "k", "team": "t", "model": "m"}).decode()
    assert service._one(_record("cut", "UPE", "upstream_reset_after_response_started",
                                checked)) == 0
    assert service._one(_record("left", "DC", "downstream_remote_disconnect")) == 0
    assert spool.in_memory == 0  # a word for the recorder, no event
    assert set(service.recorder._told) == {"cut", "left"}

    seq = service._one(_record("failed", "UAEX", c.AUTHZ_ERROR_DETAILS))
    assert seq == 1 and spool.in_memory == 1
    event = orjson.loads(spool._queue[0])
    assert (event["event_id"], event["outcome"], event["status_code"]) == (
        "failed", "denied", 503)
    assert service._one(_record("failed", "UAEX", c.AUTHZ_ERROR_DETAILS)) == 1  # sent again
    assert spool.in_memory == 1  # recorded once
    spool.close()
