"""A sidecar stopped with SIGTERM (a rolling update) while an ext_proc stream runs: the stream
is cut when the stop's grace runs out, and its one usage event is still written by the
stopping sidecar (its spool, shipped on restart), with what had streamed, not left to the
orphan sweep a lease later."""

from __future__ import annotations

import contextlib
from pathlib import Path

from testkit.spoke import client, read_events, start_spoke

LEASE_TTL_S = 60  # an orphan's event would come a minute later: far past this test's wait


def test_sigterm_mid_stream_still_writes_its_event(tmp_path: Path) -> None:
    spoke, keys = start_spoke(tmp_path / "spoke", metering="ext_proc",
                              sidecar_env={"GATEWAY_LEASE_TTL_S": str(LEASE_TTL_S)})
    try:
        c = client(spoke, keys["fault"], default_headers={"x-mock-tokens-per-s": "20"})
        raw = c.chat.completions.with_raw_response.create(
            model="mock-model", messages=[{"role": "user", "content": "count to a thousand"}],
            max_tokens=1000, stream=True)  # ~50 s: still running when the sidecar stops
        rid = str(raw.headers["x-request-id"])
        stream = raw.parse()
        for i, _ in enumerate(stream):
            if i == 4:
                break
        spoke["sidecar"].stop(timeout=15)  # SIGTERM; waits for it to exit
        with contextlib.suppress(Exception):  # the rest, up to the cut, however it shows
            for _ in stream:
                pass
        stream.close()
        spoke["sidecar"].restart()  # ships what the stopped one spooled
        events = read_events(spoke.kafka_bootstrap, {rid}, timeout=15)
        assert len(events) == 1, events
        (e,) = events
        assert e["outcome"] in ("client_cancelled", "upstream_error"), e
        assert int(e["usage"]["completion_tokens"]) >= 4, e  # what streamed, not an orphan's 0
    finally:
        spoke.stop()
