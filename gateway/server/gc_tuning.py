"""What the cyclic garbage collector does with a serving process, once it has started."""

from __future__ import annotations

import gc

from gateway.log import log

# Collect the youngest generation after 10,000 net container allocations, not 700, and each
# older one after 50 collections of the one below, not 10. A request leaves ~0.1 objects in
# reference cycles (measured at c=32), so what waits for a collection stays small; what the
# defaults cost was a full collection of the start-up heap every ~15 s under load, holding
# the event loop 50-89 ms (docs/benchmarks.md, "Garbage collection after start-up").
THRESHOLDS = (10_000, 50, 50)


def tune_gc_after_startup() -> None:
    """Move what start-up left alive (modules, the policy, the servers) to the permanent
    generation, so that no collection scans it again, and collect less often."""
    gc.collect()  # start-up's own garbage, not frozen with the rest
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    log.info("gc_tuned", frozen=gc.get_freeze_count(), thresholds=list(THRESHOLDS))
