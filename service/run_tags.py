"""Job states onto MLflow runs (`csx.status`, `csx.status_message`), off the request path.

A state change used to tag its run synchronously: with the MLflow server away, MLflow's client
retried for minutes inside the cancel handler and the scheduler thread. Now `states.move`
queues the tag and one daemon thread applies the queue in order, each tag with a bounded number
of tries; the database row stays the source of truth, so a tag that never lands is logged, not
fatal. `flush()` waits until everything queued so far is applied (tests, shutdown).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

TRIES = 5
RETRY_PAUSE_S = 2.0

# One queue and thread per tracking server: one that is away holds up only its own tags.
_queues: dict[str, queue.Queue[tuple[str, dict[str, str]]]] = {}
_lock = threading.Lock()


def submit(tracking_uri: str, run_id: str, tags: dict[str, str]) -> None:
    """Queue `tags` for the run; returns at once."""
    with _lock:
        pending = _queues.get(tracking_uri)
        if pending is None:
            pending = _queues[tracking_uri] = queue.Queue()
            threading.Thread(target=_apply_forever, args=(tracking_uri, pending),
                             name="csx-run-tags", daemon=True).start()
    pending.put((run_id, tags))


def flush(tracking_uri: str, timeout_s: float = 30.0) -> bool:
    """True once every tag queued for `tracking_uri` before the call was applied (or given
    up on)."""
    with _lock:
        pending = _queues.get(tracking_uri)
    deadline = time.monotonic() + timeout_s
    while pending is not None and pending.unfinished_tasks:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _apply_forever(tracking_uri: str, pending: queue.Queue[tuple[str, dict[str, str]]]) -> None:
    while True:
        run_id, tags = pending.get()
        try:
            _apply(tracking_uri, run_id, tags)
        finally:
            pending.task_done()
def _apply(tracking_uri: str, run_id: str, tags: dict[str, str]) -> None:
    from mlflow.tracking import MlflowClient

    client: Any = MlflowClient(tracking_uri)
    for attempt in range(1, TRIES + 1):
        try:
            for key, value in tags.items():
                client.set_tag(run_id, key, value)
            return
        except Exception as err:  # MlflowException, connection errors: the server is away
            if attempt == TRIES:
                logger.warning("gave up tagging MLflow run %s with %s: %s", run_id, tags, err)
                return
            time.sleep(RETRY_PAUSE_S)
