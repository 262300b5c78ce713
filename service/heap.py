"""Keep the garbage collector's full passes short in a server that imports heavy libraries late.

A full (generation 2) collection walks every container object the process holds and, in
CPython, holds the GIL throughout: every request waits. The server imports torch, matplotlib
and MLflow only when its first job is planned or its first report drawn, after which a full
pass walked about 540,000 objects and took 220-340 ms on a 2-core Xeon: the p99 of 50 clients
at 100 req/s was those pauses. Objects that live as long as the process (modules, classes,
functions, their caches) never need a cyclic collection, so once a full pass finds that
modules were imported since the last time, what is alive is frozen (`gc.freeze`): later passes
walk only what came after. Imports are finite, so freezes are too; what a freeze keeps that
later becomes cyclic garbage (the objects of requests in flight at that moment) stays, a few
kilobytes each time.

Collections are also made rarer: CPython starts a young one every 700 allocations net, a
request makes thousands, and each young pass cost 10-60 ms under load. Every 20,000, with
older generations every 20 passes of the one below, one build side by side: 222 req/s against
212 from 50 waiting clients, p99 46 ms against 87 at 100 req/s (bench/route_load.py, SQLite;
docs/benchmarks.md has the runs of both databases). The garbage a request leaves waits a
little longer: kilobytes.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

THRESHOLDS = (20_000, 20, 20)  # young, middle, old (CPython's: 700, 10, 10)
# New modules since the last freeze that make a freeze worth it (an import of torch brings
# about a thousand; a request's lazily imported helper, one or two).
MIN_NEW_MODULES = 20

_frozen_at_modules = 0


def _after_collection(phase: str, info: dict[str, Any]) -> None:
    global _frozen_at_modules
    if phase != "stop" or info["generation"] != 2:
        return
    if len(sys.modules) - _frozen_at_modules >= MIN_NEW_MODULES:
        _frozen_at_modules = len(sys.modules)
        gc.freeze()


def tune_collection() -> None:
    """Rarer collections, and what is alive frozen after each full collection that follows new
    imports (once per process, however often called)."""
    gc.set_threshold(*THRESHOLDS)
    if _after_collection not in gc.callbacks:
        gc.callbacks.append(_after_collection)
