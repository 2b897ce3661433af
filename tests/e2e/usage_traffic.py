"""Requests through a spoke's Envoy for the usage tests (test_delivery.py,
test_usage_consume_cli.py): half plain, half streamed, each a 200 whatever Kafka does."""

from __future__ import annotations

from testkit.spoke import client

MSG = [{"role": "user", "content": "hello there"}]
# `usage consume`'s group session: Tansu holds each JoinGroup for half of it, and a join
# after another member left waited most of the 6 s default's again (the cron test keeps
# the default).
SESSION = ["--session-timeout-s", "2"]


def send_requests(spoke, key: str, n: int) -> set[str]:  # type: ignore[no-untyped-def]
    c = client(spoke, key)
    ids = set()
    for i in range(n):
        if i % 2:
            raw = c.chat.completions.with_raw_response.create(
                model="mock-model", messages=MSG, max_tokens=3, stream=True)
            list(raw.parse())
        else:
            raw = c.chat.completions.with_raw_response.create(
                model="mock-model", messages=MSG, max_tokens=3)
        assert raw.status_code == 200  # the client never waits for Kafka
        ids.add(raw.headers["x-request-id"])
    return ids
