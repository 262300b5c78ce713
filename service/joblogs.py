"""Each job's log: a text file in the job's folder under runs_dir, next to its checkpoints."""

from __future__ import annotations

import threading
from collections import deque
from datetime import UTC, datetime
from pathlib import Path

_lock = threading.Lock()


def job_dir(runs_dir: Path, job_id: int, run_key: str | None) -> Path:
    """runs_dir/job-<id>-<run key>; job-<id> for a job from before run keys."""
    return runs_dir / (f"job-{job_id}" if run_key is None else f"job-{job_id}-{run_key}")


def log_path(folder: Path) -> Path:
    return folder / "job.log"


def append(folder: Path, text: str) -> None:
    path = log_path(folder)
    stamp = datetime.now(UTC).isoformat(timespec="milliseconds")
    with _lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as log:
            for line in text.rstrip("\n").splitlines() or [""]:
                log.write(f"{stamp} {line}\n")


def tail(folder: Path, lines: int) -> str:
    path = log_path(folder)
    if not path.exists():
        return ""
    with path.open(encoding="utf-8", errors="replace") as log:
        return "".join(deque(log, maxlen=lines))
