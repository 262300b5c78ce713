"""Each job's log: a text file in the job's folder under runs_dir, next to its checkpoints.

The log is the service's own regular file: a link or special file planted in its place is
neither written through nor served. Writing it is best effort: the scheduler writes a job's
log before recording its state, and a full disk must not stop that record.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from training.safe_files import RefusedFile, open_regular, require_regular

logger = logging.getLogger(__name__)
_lock = threading.Lock()


def job_dir(runs_dir: Path, job_id: int, run_key: str | None) -> Path:
    """runs_dir/job-<id>-<run key>; job-<id> for a job from before run keys."""
    return runs_dir / (f"job-{job_id}" if run_key is None else f"job-{job_id}-{run_key}")


def log_path(folder: Path) -> Path:
    return folder / "job.log"


def _open_for_append(path: Path) -> IO[str]:
    """The log opened to append, without following a link or blocking on a FIFO."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                 | os.O_CLOEXEC, 0o644)
    try:
        require_regular(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "a", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


def append(folder: Path, text: str) -> None:
    """Add `text` to the job's log, each line time-stamped; a failure (a full disk, a planted
    link) is logged by the service and otherwise ignored."""
    path = log_path(folder)
    stamp = datetime.now(UTC).isoformat(timespec="milliseconds")
    lines = "".join(f"{stamp} {line}\n" for line in text.rstrip("\n").splitlines() or [""])
    try:
        with _lock:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _open_for_append(path) as log:
                log.write(lines)
    except (OSError, RefusedFile) as err:
        logger.warning("job log %s not written (%s): %s", path, err, lines.rstrip("\n")[-500:])


def tail(folder: Path, lines: int) -> str:
    """The log's last `lines` lines; a log that is not a regular file in the job's folder is
    not read, and the answer says why."""
    path = log_path(folder)
    try:
        with open_regular(path, inside=folder, text=True, encoding="utf-8", errors="replace") as log:
            return "".join(deque(log, maxlen=lines))
    except FileNotFoundError:
        return ""
    except RefusedFile as err:
        return f"{path.name} is not served: it {err.why}\n"
