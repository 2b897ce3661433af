"""A process's usage events from its spool to the sink: its own spool, and any a dead
instance left behind (adopted, shipped until empty), each drained by a shipper into Kafka
or the JSONL file. The App starts it, the Recorder writes into its spool, and a stop gives
it LAST_DELIVERY_S to deliver before it closes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.log import log
from gateway.settings import Settings
from gateway.sinks.gate import UsageGate
from gateway.sinks.producers import JsonlProducer, KafkaProducer, Producer
from gateway.sinks.shipper import Shipper
from gateway.sinks.spool import Spool
from gateway.sinks.spools import orphans
from gateway.tasks import watched

# At a stop, the longest the shipper is given to deliver what the spool holds (a sink that
# answers takes milliseconds; one that does not leaves them spooled for the next start).
LAST_DELIVERY_S = 1.0


@dataclass
class UsagePipeline:
    spool: Spool  # this instance's
    spools: list[Spool]  # its own first, then those adopted
    producer: Producer

    @classmethod
    def start(cls, s: Settings, instance_id: str, gate: UsageGate,
              tasks: list[asyncio.Task[None]]) -> UsagePipeline:
        """Open the spools and start the writer and a shipper each (into `tasks`)."""
        spool = Spool(s.spool_dir, instance_id, gate=gate).open()
        spools = [spool, *orphans(s.spool_dir, instance_id)]
        producer: Producer = (
            KafkaProducer(s.kafka_bootstrap, s.usage_topic, s.kafka_idempotence)
            if s.kafka_bootstrap else JsonlProducer(s.usage_jsonl))
        tasks.append(watched(spool.run_writer(), "spool_writer"))
        for sp in spools:
            tasks.append(watched(Shipper(sp, producer).run(until_empty=sp is not spool),
                                 f"shipper {sp.instance_id}"))
        if len(spools) > 1:
            log.warning("adopted_spools", spools=[sp.instance_id for sp in spools[1:]],
                        events=sum(sp.depth for sp in spools[1:]))
        return cls(spool, spools, producer)

    def resettle(self, window: float,
                 settle: Callable[[Iterable[bytes], float], int]) -> int:
        """The last run may have been killed between an event's fsync and its settlement:
        each spool's tail (the events of its last `window` seconds) goes to `settle` (lines,
        since) again, once; the store ignores what it no longer holds."""
        done = 0
        for sp in self.spools:
            done += settle(sp.tail, sp.tail_written_at - window)
            sp.tail = []
        return done

    async def deliver(self, within: float = LAST_DELIVERY_S) -> None:
        """Let the shipper deliver what the spool holds, for up to `within`: a stopping
        sidecar whose sink answers leaves nothing behind. (Its last events waited for the
        same instance's next start: a pod replaced in a rolling update has a new name, and
        a spool left behind is adopted only when an instance starts.) A sink that does not
        answer: they wait in the spool, as before."""
        spool = self.spool
        deadline = time.monotonic() + within
        while spool.delivered < spool.durable_seq and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        """After the shippers' tasks are cancelled: the producer, then the spool (its
        delivered mark written)."""
        with contextlib.suppress(Exception):
            await self.producer.close()
        self.spool.close()
