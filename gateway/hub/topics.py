"""The hub's topics on Kafka: produce keyed JSON, read a compacted topic whole, follow one.

Compacted topics keep the latest value per key; a reader that reads every record in order
and keeps the last per key (a null value deletes) gets the same answer whether or not the
broker compacts (Tansu does not: docs/kafka-broker.md quirk 4). Nothing here trusts
`ListOffsets(latest)` (quirk 3): a read ends when every partition's position reaches the
high-water mark its fetches report.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, for_code

from gateway.errors import SinkUnavailable, TopicRefused
from gateway.hub.feed import Record
from gateway.log import log
from gateway.sinks.producers import kafka_unavailable

POLICY_TOPIC = "llm.policy.v1"
STATUS_TOPIC = "llm.gateway.status.v1"
_TOPIC_EXISTS = 36  # Kafka's TOPIC_ALREADY_EXISTS
_REPLICATION_REFUSED = 38  # INVALID_REPLICATION_FACTOR (e.g. more than the brokers)
_CONFIG_REFUSED = (40, 44)  # INVALID_CONFIG, POLICY_VIOLATION
# The largest record `produce` writes (a policy document of ~150,000 keys; one of 10,000 is
# already over Kafka's 1 MB default), and the topic setting `hub publish` creates the feed
# with so that a Kafka takes it. Records go gzip-compressed: keys' hex digests halve.
RECORD_MAX_BYTES = 16 << 20
# Kafka compacts only closed segments, and closes one after 7 days by default: the status
# topic (a report per instance every 10 s) would hold a week of reports uncompacted, which
# every `hub status` reads whole (100 instances: 6 million records, past its 10 s). An
# hour's segments keep what a reader reads near one value per key.
SEGMENT_MS = 3_600_000


async def ensure_compacted(bootstrap: str, topic: str, max_bytes: int | None = None, *,
                           replication: int = 1, required: bool = False) -> bool:
    """Create `topic` compacted, one partition, kept on `replication` brokers
    (GATEWAY_TOPIC_REPLICATION), if it is missing (best effort: a broker that auto-creates
    topics works without it, uncompacted; a topic already there is left as it is), taking
    records up to `max_bytes` (None: the broker's default). True once the broker answered
    (created, already there, or refused for good: asking again would not change it); False
    when it could not be asked (Kafka away): ask again before the next write.

    `required` (the policy feed: a plain topic drops its records after the retention, and
    with them the revision new spokes start from): a refused creation is not left to
    auto-creation. Only then is the broker asked whether the topic exists (an operator made
    it; a managed Kafka may refuse a create, e.g. TOPIC_AUTHORIZATION_FAILED, even for a
    topic there): it is used as it is; else TopicRefused, naming the broker's error and the
    fix, and the caller writes nothing."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    configs = {"cleanup.policy": "compact", "segment.ms": str(SEGMENT_MS),
               **({"max.message.bytes": str(max_bytes)} if max_bytes else {})}
    try:
        await admin.start()
        res = await admin.create_topics(
            [NewTopic(topic, 1, replication, topic_configs=configs)])
        codes = [code for _, code, *_ in res.topic_errors]
        if any(code in _CONFIG_REFUSED for code in codes):
            # a managed Kafka that caps a setting (e.g. max.message.bytes at 8 MiB): the
            # topic compacted with the broker's own sizes, rather than none made at all
            log.warning("topic_settings_refused", topic=topic, error_codes=codes, asked=configs)
            res = await admin.create_topics(
                [NewTopic(topic, 1, replication, topic_configs={"cleanup.policy": "compact"})])
        refused = [(code, rest[0] if rest else None)
                   for _, code, *rest in res.topic_errors if code not in (0, _TOPIC_EXISTS)]
        if required and refused:
            await _exists_or_refused(admin, topic, *refused[0], replication,
                                     bool(max_bytes))
            return True
        for code, _ in refused:
            log.warning("topic_not_created", topic=topic, error_code=code,
                        replication=replication, **_refusal(code, replication))
        return True
    except (KafkaError, OSError) as exc:
        log.warning("topic_not_created", topic=topic, error=repr(exc))
        return False
    finally:
        with contextlib.suppress(Exception):
            await admin.close()


async def _exists_or_refused(admin: AIOKafkaAdminClient, topic: str, code: int,
                             message: str | None, replication: int,
                             sized: bool) -> None:
    """After the broker refused to create `topic`: None if it exists all the same, else
    TopicRefused. Every topic's metadata is asked, not `topic`'s own: a Metadata request
    naming a topic lets a broker that auto-creates topics make it (plain) in answering."""
    name = for_code(code).message
    said = f": {message}" if message else ""
    try:
        there = topic in await admin.list_topics()
    except (KafkaError, OSError) as exc:
        raise TopicRefused(
            f"the broker refused to create {topic} (error {code} {name}{said}), and whether "
            f"it exists could not be told ({exc!r}): try again") from exc
    if there:
        log.info("topic_create_refused_exists", topic=topic, error_code=code, error=name,
                 note="the topic exists (made otherwise): used as it is")
        return
    size = ", max.message.bytes at least the largest document" if sized else ""
    raise TopicRefused(
        f"the broker refused to create {topic} (error {code} {name}{said}) and it does not "
        f"exist: create {topic} yourself with cleanup.policy=compact{size}, or set "
        f"GATEWAY_TOPIC_REPLICATION (now {replication}) to what the cluster holds; not "
        f"written to, lest a broker that auto-creates topics make it plain (delete "
        f"retention: the revisions would go after a week)")


def _refusal(code: int, replication: int) -> dict[str, str]:
    """What a refused creation likely means, for its log line: the setting to change."""
    goes_on = ("writes go on (a broker that auto-creates topics makes it plain, "
               "uncompacted)")
    if code == _REPLICATION_REFUSED:
        return {"reason": f"the broker refused replication factor {replication} "
                          f"(INVALID_REPLICATION_FACTOR: more than it has brokers?): set "
                          f"GATEWAY_TOPIC_REPLICATION to what it can hold, or create the "
                          f"topic yourself, compacted; {goes_on}"}
    if code in _CONFIG_REFUSED:  # refused even with the compaction alone asked
        return {"reason": f"refused even with compaction alone asked: the broker's policy "
                          f"may want another replication factor than {replication} "
                          f"(GATEWAY_TOPIC_REPLICATION), or forbid compaction: create the "
                          f"topic yourself, compacted; {goes_on}"}
    return {}


class CompactedTopic:
    """A topic its first writer creates compacted (DESIGN §10: the hub's topics are): the
    broker is asked once per process, before the first write, and again after a failure to
    ask, so a broker that auto-creates topics never makes it plain first."""

    def __init__(self, bootstrap: str, topic: str, timeout: float = 5.0, *,
                 replication: int = 1) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.timeout = timeout
        self.replication = replication  # GATEWAY_TOPIC_REPLICATION
        self.ready = False

    async def ensure(self) -> None:
        if self.ready:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.timeout):
                self.ready = await ensure_compacted(self.bootstrap, self.topic,
                                                   replication=self.replication)


async def produce(bootstrap: str, topic: str, key: str, value: bytes | None, *,
                  idempotence: bool = True) -> None:
    """One keyed record, acks=all, gzip-compressed, up to RECORD_MAX_BYTES; SinkUnavailable
    if Kafka did not take it."""
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", compression_type="gzip",
                         max_request_size=RECORD_MAX_BYTES,
                         enable_idempotence=idempotence, request_timeout_ms=10000)
    try:
        await p.start()
        await p.send_and_wait(topic, key=key.encode(), value=value)
    except (KafkaError, OSError) as exc:
        raise kafka_unavailable(bootstrap, exc, idempotence) from exc
    finally:
        await p.stop()


async def start_consumer(c: AIOKafkaConsumer) -> None:
    """`c.start()`; when it fails (no broker answers), the consumer is stopped before the
    error goes on, so no 'Unclosed AIOKafkaConsumer' follows the error line (or each retry
    of an outage)."""
    try:
        await c.start()
    except BaseException:
        with contextlib.suppress(Exception):
            await stop_consumer(c)
        raise


async def stop_consumer(c: AIOKafkaConsumer) -> None:
    """`c.stop()`, also when the broker refused its last fetch. aiokafka's fetcher then sits
    out its retry backoff; `stop()` cancels that fetch and awaits it, and the CancelledError
    it gets back escapes `stop()` (aiokafka 0.14; aio-libs/aiokafka#647) before the client
    closes. Let through, it would end a follower for good whenever Kafka is down. So it is
    taken here, the rest of the close done; a cancellation of the caller itself goes on."""
    try:
        await c.stop()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        for fetch in list(getattr(getattr(c, "_fetcher", None), "_pending_tasks", ())):
            fetch.cancel()
        with contextlib.suppress(Exception):
            await c._client.close()


def _consumer(bootstrap: str) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                            enable_auto_commit=False, auto_offset_reset="earliest",
                            request_timeout_ms=10000, metadata_max_age_ms=2000,
                            fetch_max_wait_ms=200)  # a new revision waits at most this


def _decoded(msgs: dict[TopicPartition, list[Any]]) -> list[Record]:
    """(key, value) of each record. A key that is not UTF-8 (no spoke id is) is decoded with
    replacement, as the quota topic's are: no spoke follows it, and it stops no reader."""
    return [(m.key.decode(errors="replace") if m.key else "", m.value)
            for batch in msgs.values() for m in batch]


async def _metadata(c: AIOKafkaConsumer) -> Any:
    """A fresh metadata round trip (KafkaError when no broker answers). The consumer's own
    view may not know a topic created since it started, so its partitions are read here."""
    return await c._client.fetch_all_metadata()


async def probe(c: AIOKafkaConsumer, timeout_s: float) -> None:
    """Kafka answers within `timeout_s`, or this raises (KafkaError, TimeoutError): a consumer
    alone never says the broker is away, it retries quietly."""
    async with asyncio.timeout(timeout_s):
        await _metadata(c)


async def _assign_all(c: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """Every partition of `topic` from its beginning; [] if the topic does not exist yet."""
    parts = (await _metadata(c)).partitions_for_topic(topic)
    if not parts:
        return []
    tps = [TopicPartition(topic, p) for p in sorted(parts)]
    c.assign(tps)
    await c.seek_to_beginning(*tps)
    return tps


async def _caught_up(c: AIOKafkaConsumer, tps: list[TopicPartition]) -> bool:
    for tp in tps:
        high = c.highwater(tp)
        if high is None or await c.position(tp) < high:
            return False
    return True


async def read_all(bootstrap: str, topic: str, timeout: float = 10.0) -> list[Record]:
    """Every record of `topic` (key, value), each partition in order, up to its end now.

    SinkUnavailable when Kafka does not answer, or the end is not reached within `timeout`.
    """
    c = _consumer(bootstrap)
    out: list[Record] = []
    try:
        async with asyncio.timeout(timeout):
            await c.start()
            tps = await _assign_all(c, topic)
            while tps:
                out += _decoded(await c.getmany(timeout_ms=100))
                if await _caught_up(c, tps):
                    break
    except (KafkaError, OSError, TimeoutError) as exc:
        raise SinkUnavailable(f"kafka {bootstrap}: reading {topic}: {exc!r}") from exc
    finally:
        await stop_consumer(c)
    return out


class Follower:
    """Follows a topic from its beginning for as long as it runs, and says whether Kafka
    answers (a consumer alone never says: it retries quietly)."""

    def __init__(self, bootstrap: str, topic: str, probe_s: float = 2.0) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.probe_s = probe_s
        self.up = False
        self.error = "not connected yet"
        self.generation = 0  # +1 each time it starts reading again from the beginning
        self.caught_up = False  # this generation has read up to the topic's end once

    def _mark(self, error: str | None) -> None:
        if error is None:
            self.up, self.error = True, ""
        else:
            if self.up or self.error != error:
                log.warning("hub_feed_unreachable", topic=self.topic, error=error)
            self.up, self.error = False, error

    async def batches(self) -> AsyncIterator[list[Record]]:
        """Lists of new records as they arrive; an empty list at least every `probe_s`
        (after a probe of Kafka, so `up` is fresh). Never ends; never raises for Kafka.
        After a failure it reads the topic again from its start (`generation` changes)."""
        while True:
            c = _consumer(self.bootstrap)
            self.generation += 1
            self.caught_up = False
            try:
                async with asyncio.timeout(self.probe_s + 3):
                    await c.start()
                    tps = await _assign_all(c, self.topic)
                self._mark(None)
                while not tps:  # no revision published yet
                    self.caught_up = True
                    yield []
                    await asyncio.sleep(self.probe_s)
                    async with asyncio.timeout(self.probe_s + 3):
                        tps = await _assign_all(c, self.topic)
                    self._mark(None)
                probed = time.monotonic()
                self.caught_up = False  # the topic exists now: read it to its end first
                while True:
                    records = _decoded(await c.getmany(timeout_ms=int(self.probe_s * 500)))
                    if not self.caught_up:
                        self.caught_up = await _caught_up(c, tps)
                    if time.monotonic() - probed >= self.probe_s:
                        await probe(c, self.probe_s + 1)
                        self._mark(None)
                        probed = time.monotonic()
                    yield records
            except (KafkaError, OSError, TimeoutError) as exc:
                self._mark(repr(exc))
                yield []
                await asyncio.sleep(min(self.probe_s, 1.0))
            except Exception as exc:  # a client bug must not end the follower: start over
                log.exception("hub_feed_follower_crashed", topic=self.topic)
                self._mark(repr(exc))
                yield []
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await stop_consumer(c)
