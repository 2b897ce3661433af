"""`gateway hub status` without Kafka: the fleet view built from the topics' latest values,
its JSON shape (DESIGN §10), which spokes lag, and the table."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import orjson

from gateway.hub import feed, fleet
from gateway.hub.status import Status, rfc3339

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC).timestamp()


def report(spoke: str, instance: str, revision: int, state: str = "ack",
           error: str | None = None, ago: float = 1.0, spool_depth: int = 0,
           spool_oldest_s: float = 0.0, limiter_store_up: bool = True) -> tuple[str, bytes]:
    at = rfc3339(datetime.fromtimestamp(NOW - ago, UTC))
    s = Status(spoke, instance, revision, state, error, at, spool_depth, spool_oldest_s,
               limiter_store_up)
    return s.key, s.encode()


def test_the_report_has_the_contract_fields_in_order() -> None:
    key, raw = report("a", "i1", 3, spool_depth=2, spool_oldest_s=1.5)
    assert key == "a/i1"
    assert list(orjson.loads(raw)) == ["spoke", "instance", "revision", "state", "error", "at",
                                       "spool_depth", "spool_oldest_s", "limiter_store_up"]
    assert orjson.loads(raw)["at"] == "2026-12-01T11:59:59.000Z"


def test_fleet_view_has_the_contract_shape_and_the_feed_revision_per_spoke() -> None:
    statuses = dict([report("b", "side", 4), report("a", "sync", 5, ago=2.5),
                     report("a", "side", 5, "nack", "models.m: bad", spool_depth=3,
                            spool_oldest_s=7.0, limiter_store_up=False)])
    policies = {"*": feed.encode(4, {}), "a": feed.encode(5, {}), "c": feed.encode(6, {})}
    view = fleet.fleet(statuses, policies, NOW)
    assert [s["spoke"] for s in view["spokes"]] == ["a", "b", "c"]  # c: own entry, no report
    a, b, c = view["spokes"]
    assert (a["feed_revision"], b["feed_revision"], c["feed_revision"]) == (5, 4, 6)
    assert c["instances"] == []
    assert a["instances"][0] == {
        "instance": "side", "revision": 5, "state": "nack", "error": "models.m: bad",
        "age_s": 1.0, "spool_depth": 3, "spool_oldest_s": 7.0, "limiter_store_up": False}
    assert a["instances"][1]["age_s"] == 2.5
    assert set(view) == {"spokes"} and set(a) == {"spoke", "feed_revision", "instances"}


def test_lagging_names_the_instances_behind_the_feed() -> None:
    statuses = dict([report("a", "new", 7), report("a", "old", 6), report("b", "x", 6)])
    view = fleet.fleet(statuses, {"*": feed.encode(6, {}), "a": feed.encode(7, {})}, NOW)
    assert [fleet.lagging(s) for s in view["spokes"]] == [["old"], []]
    text = fleet.table(view, interval=10)
    assert "spoke a: feed revision 7, LAGGING (1 behind)" in text
    assert "spoke b: feed revision 6, in step" in text


def test_a_spoke_nobody_reports_for_is_not_in_step() -> None:
    """A feed entry for a spoke with no instance on the status topic (never started, or a
    typo in `--spoke`) is nobody serving it: the table says so rather than `in step`."""
    view = fleet.fleet(dict([report("a", "x", 7)]), {"a": feed.encode(7, {}),
                                                     "eu-1": feed.encode(8, {})}, NOW)
    text = fleet.table(view, interval=10)
    assert "spoke a: feed revision 7, in step" in text
    assert "spoke eu-1: feed revision 8, NO INSTANCE REPORTS" in text


def test_an_instance_above_the_feed_is_not_in_step() -> None:
    """A spoke holding revision 9 while the feed says 7 (a local apply, or the topic lost its
    entry) serves a document the hub does not have, and will not take 7: the table says so."""
    statuses = dict([report("a", "side", 9), report("a", "sync", 7), report("b", "x", 6)])
    view = fleet.fleet(statuses, {"a": feed.encode(7, {}), "b": feed.encode(7, {})}, NOW)
    assert [fleet.ahead(s) for s in view["spokes"]] == [["side"], []]
    text = fleet.table(view, interval=10)
    assert "spoke a: feed revision 7, AHEAD OF THE FEED (1: publish again)" in text
    assert "spoke b: feed revision 7, LAGGING (1 behind)" in text


def test_an_unreadable_report_shows_rather_than_vanishes() -> None:
    view = fleet.fleet({"a/i": b"{garbage"}, {}, NOW)
    inst = view["spokes"][0]["instances"][0]
    assert inst["instance"] == "i" and inst["state"] == "unreadable"
    assert inst["error"].startswith("a/i: ")


def test_the_table_marks_silent_instances_and_a_down_store() -> None:
    statuses = dict([report("a", "quiet", 1, ago=45), report("a", "down", 1,
                                                            limiter_store_up=False)])
    text = fleet.table(fleet.fleet(statuses, {"*": feed.encode(1, {})}, NOW), interval=10)
    quiet = next(ln for ln in text.splitlines() if "quiet" in ln)
    down = next(ln for ln in text.splitlines() if " down " in ln)
    assert "45s!" in quiet and " up" in quiet
    assert "DOWN" in down
    assert fleet.table({"spokes": []}, 10).startswith("no spoke has reported")


def test_an_instance_nacks_while_the_newest_revision_it_saw_was_refused() -> None:
    from gateway.policy.holder import PolicyHolder
    from gateway.policy.loader import load

    holder, seen = PolicyHolder(), []
    holder.on_change.append(lambda: seen.append(holder.verdict()))
    holder.swap(load(b"models: {m: {}}", 3))
    holder.reject(4, "models.m: bad")
    holder.swap(load(b"models: {m: {}}", 5))
    holder.reject(2, "old news")  # refused, but older than what it serves: still ACK
    assert seen == [("ack", None), ("nack", "models.m: bad"), ("ack", None), ("ack", None)]


def test_a_publish_goes_above_the_highest_revision_any_instance_reports() -> None:
    statuses = dict([report("a", "i1", 4), report("b", "sync-h", 9), report("b", "i2", 7)])
    assert fleet.highest_reported(statuses) == 9
    assert fleet.highest_reported({**statuses, "c/x": b"junk", "c/y": b"[1]",
                                   "c/z": b'{"revision": true}', "c/w": b'{"revision": 99.5}',
                                   "c/v": b'{"revision": "12"}'}) == 9  # only integers count
    assert fleet.highest_reported({}) == 0


def test_an_embedded_instance_reports_a_policy_file_it_refuses_as_its_nack(tmp_path) -> None:
    """DESIGN §10: every `gateway serve` instance reports on each revision it refuses; in
    embedded mode a revision is an edit of the policy file."""
    from gateway.policy.holder import FilePolicySync, PolicyHolder

    path = tmp_path / "policy.yaml"
    path.write_text("models: {m: {}}\n")
    holder, seen = PolicyHolder(), []
    holder.on_change.append(lambda: seen.append(holder.verdict()))
    sync = FilePolicySync(holder, path)
    sync.refresh()
    path.write_text("models: {m: {limits: {rps: -3}}}\n")  # refused: revision 1 keeps serving
    sync.refresh()
    assert holder.policy is not None and holder.policy.revision == 1
    state, error = holder.verdict()
    assert state == "nack" and error is not None and "rps" in error
    path.write_text("models: {m: {}, n: {}}\n")  # mended: the next revision is taken
    sync.refresh()
    assert holder.policy.revision == 2 and holder.verdict() == ("ack", None)
    assert [s for s, _ in seen] == ["ack", "nack", "ack"]


def test_a_report_with_fields_of_another_type_is_unreadable_and_breaks_no_view() -> None:
    """A foreign or older reporter's value: `hub status -o json` gives only the contract's
    types, and the table is still drawn (a revision "3" crashed it, a TypeError)."""
    odd = orjson.dumps({"revision": "3", "state": "ack", "at": 1764590399, "spool_depth": 2,
                        "spool_oldest_s": "1", "limiter_store_up": 1})
    view = fleet.fleet({"a/odd": odd, **dict([report("a", "fine", 3)])},
                       {"*": feed.encode(3, {})}, NOW)
    inst = view["spokes"][0]["instances"][1]
    assert inst == {"instance": "odd", "revision": None, "state": "unreadable",
                    "error": 'a/odd: not of the contract\'s type: revision: "3", at: 1764590399, '
                             'spool_oldest_s: "1", limiter_store_up: 1',
                    "age_s": None, "spool_depth": 2, "spool_oldest_s": None,
                    "limiter_store_up": None}
    text = fleet.table(view, interval=10)
    assert "unreadable" in text and "LAGGING (1 behind)" in text


def test_a_report_time_without_an_offset_is_read_as_utc(monkeypatch) -> None:
    """Not as the hub's local time: `hub status` on an operator's machine east of UTC read
    such a report as hours old (or, west of it, as just now)."""
    naive = orjson.dumps({"revision": 1, "state": "ack", "at": "2026-12-01T11:59:30"})
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        view = fleet.fleet({"a/i": naive}, {}, NOW)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert view["spokes"][0]["instances"][0]["age_s"] == 30.0


def test_an_instance_silent_for_good_is_silent_not_lagging_and_long_names_keep_columns() -> None:
    """A pod replaced by a rollout stops reporting at the revision it had: after the next
    publish, the table said its spoke was LAGGING until someone ran `hub forget`, hiding
    whether the live instances had the revision. And an instance name over 28 characters
    (a syncer's sync-<fqdn>) pushed its row's columns out of line."""
    long = "sync-node-3.eu-west.cluster.internal"
    statuses = dict([report("a", "gone", 6, ago=86400), report("a", "live", 7),
                     report("a", long, 7), report("b", "gone", 6, ago=3600),
                     report("c", "live", 6, "nack", "llm.policy.v1[c] revision 7: bad")])
    view = fleet.fleet(statuses, {"*": feed.encode(7, {})}, NOW)
    text = fleet.table(view, interval=10)
    assert "spoke a: feed revision 7, in step, SILENT (1: over 3 heartbeats)" in text
    assert "spoke b: feed revision 7, SILENT (1: over 3 heartbeats)" in text
    assert "spoke c: feed revision 7, LAGGING (1 behind), NACK (1)" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("  ") and "spoke" not in ln]
    rev_at = {ln.index(" REV ") if "INSTANCE" in ln else None for ln in rows} - {None}
    assert len(rev_at) == 1  # one header layout for all spokes
    col = rev_at.pop() + 3  # the REV column's last character
    assert all(ln[col] in "67V" for ln in rows), text
