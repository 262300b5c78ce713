"""Each job's log: a text file under runs_dir/<job id>/, next to its checkpoints."""

from __future__ import annotations

import threading
from collections import deque
from datetime import UTC, datetime
from pathlib import Path

_lock = threading.Lock()


def job_dir(runs_dir: Path, job_id: int) -> Path:
    return runs_dir / f"job-{job_id}"


def log_path(runs_dir: Path, job_id: int) -> Path:
    return job_dir(runs_dir, job_id) / "job.log"


def append(runs_dir: Path, job_id: int, text: str) -> None:
    path = log_path(runs_dir, job_id)
    stamp = datetime.now(UTC).isoformat(timespec="milliseconds")
    with _lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as log:
            for line in text.rstrip("\n").splitlines() or [""]:
                log.write(f"{stamp} {line}\n")


def tail(runs_dir: Path, job_id: int, lines: int) -> str:
    path = log_path(runs_dir, job_id)
    if not path.exists():
        return ""
    with path.open(encoding="utf-8", errors="replace") as log:
        return "".join(deque(log, maxlen=lines))
