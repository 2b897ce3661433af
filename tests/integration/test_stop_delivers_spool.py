"""A sidecar that stops (SIGTERM) delivers what its spool holds before it exits, while its
sink answers: its last events do not wait for the next start of the same instance (a pod
replaced in a rolling update has a new name, and a spool is adopted only at a start)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import yaml

from devspoke.procs import free_port
from gateway.server.app import App
from gateway.settings import Settings


def test_a_stop_delivers_the_events_it_spooled_just_before(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"models": {"m": {}}, "teams": {"t": {"models": ["*"]}}}))
    sink = tmp_path / "usage.jsonl"
    settings = Settings(policy_file=policy, spool_dir=tmp_path / "spool", usage_jsonl=sink,
                        listen=f"127.0.0.1:{free_port()}", authz_http_listen="",
                        metrics_listen=f"127.0.0.1:{free_port()}")

    async def run() -> int:
        app = App(settings, "i-1")
        await app.start()
        assert app.usage is not None
        spool = app.usage.spool
        seqs = [spool.next_seq() for _ in range(3)]
        for seq in seqs:
            spool.put(seq, json.dumps({"seq": str(seq), "event_id": f"e{seq}"}).encode())
        await spool.until_durable(seqs[-1])  # on disk, not yet shipped (the shipper lingers)
        await app.stop(0)  # as on SIGTERM
        return spool.delivered

    delivered = asyncio.run(run())
    lines = sink.read_text().splitlines() if sink.exists() else []
    assert [json.loads(line)["event_id"] for line in lines] == ["e1", "e2", "e3"]
    assert delivered == 3
    assert (tmp_path / "spool" / "i-1" / "delivered").read_text() == "3"  # not re-sent
