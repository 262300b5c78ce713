"""MLflow writes the service makes outside a job's own logging, off the request path: job states
onto runs (`csx.status`, `csx.status_message`) and, with MLflow's authentication on, users'
permissions on their experiments (service/mlflow_auth.py).

A state change used to tag its run synchronously: with the MLflow server away, MLflow's client
retried for minutes inside the cancel handler and the scheduler thread. Now `states.move`
queues the tag and one daemon thread applies the queue in order, each write with a bounded
number of tries; the database row stays the source of truth, so a write that never lands is
logged, not fatal. `flush()` waits until everything queued so far is applied (tests, shutdown).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

TRIES = 5
RETRY_PAUSE_S = 2.0

# What a queued write does, and what it is called in a warning when it never lands.
Write = tuple[str, Callable[[], None]]
# One queue and thread per tracking server: one that is away holds up only its own writes.
_queues: dict[str, queue.Queue[Write]] = {}
_lock = threading.Lock()


def submit(tracking_uri: str, run_id: str, tags: dict[str, str]) -> None:
    """Queue `tags` for the run; returns at once."""
    def tag() -> None:
        from mlflow.tracking import MlflowClient

        client: Any = MlflowClient(tracking_uri)
        for key, value in tags.items():
            client.set_tag(run_id, key, value)

    submit_write(tracking_uri, f"tagging MLflow run {run_id} with {tags}", tag)


def submit_write(tracking_uri: str, what: str, write: Callable[[], None]) -> None:
    """Queue `write` (a call to the MLflow server at `tracking_uri`); returns at once."""
    with _lock:
        pending = _queues.get(tracking_uri)
        if pending is None:
            pending = _queues[tracking_uri] = queue.Queue()
            threading.Thread(target=_apply_forever, args=(pending,),
                             name="csx-mlflow-writes", daemon=True).start()
    pending.put((what, write))


def flush(tracking_uri: str, timeout_s: float = 30.0) -> bool:
    """True once every write queued for `tracking_uri` before the call was applied (or given
    up on)."""
    with _lock:
        pending = _queues.get(tracking_uri)
    deadline = time.monotonic() + timeout_s
    while pending is not None and pending.unfinished_tasks:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _apply_forever(pending: queue.Queue[Write]) -> None:
    while True:
        what, write = pending.get()
        try:
            _apply(what, write)
        finally:
            pending.task_done()


def _apply(what: str, write: Callable[[], None]) -> None:
    for attempt in range(1, TRIES + 1):
        try:
            write()
            return
        except Exception as err:  # MlflowException, connection errors: the server is away
            if attempt == TRIES:
                logger.warning("gave up %s: %s", what, err)
                return
            time.sleep(RETRY_PAUSE_S)
