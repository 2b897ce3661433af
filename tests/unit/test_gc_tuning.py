"""After start-up, the serving process freezes what start-up left and collects less often."""

from __future__ import annotations

import gc

from gateway.server.gc_tuning import THRESHOLDS, tune_gc_after_startup


def test_start_up_heap_is_frozen_and_thresholds_raised() -> None:
    before = gc.get_threshold()
    try:
        tune_gc_after_startup()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == THRESHOLDS
    finally:  # the test process keeps its own collector settings
        gc.unfreeze()
        gc.set_threshold(*before)
