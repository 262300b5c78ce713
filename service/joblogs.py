"""Each job's log: a text file in the job's folder under runs_dir, next to its checkpoints.

The log is the service's own regular file: a link or special file planted in its place is
neither written through nor served. Writing it is best effort: the scheduler writes a job's
log before recording its state, and a full disk must not stop that record.
"""

from __future__ import annotations

import codecs
import logging
import os
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from training.safe_files import RefusedFile, open_regular, require_regular

logger = logging.getLogger(__name__)
_lock = threading.Lock()
TAIL_BLOCK_BYTES = 64 * 1024
SEND_CHUNK_BYTES = 256 * 1024


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


def tail(folder: Path, lines: int) -> Iterator[bytes]:
    """The log's last `lines` lines as UTF-8 (undecodable bytes replaced), in chunks read as
    they are sent: the start is found by reading the file backwards block by block, so a
    request costs what it sends, never the log's size (a 524 MB log was read whole for each of
    45 readers). What is sent is the log as it was when opened. A log that is not a regular
    file in the job's folder is not read, and the answer says why."""
    path = log_path(folder)
    try:
        log = open_regular(path, inside=folder)
    except FileNotFoundError:
        return iter(())
    except RefusedFile as err:
        return iter([f"{path.name} is not served: it {err.why}\n".encode()])
    try:
        end = os.fstat(log.fileno()).st_size
        start = _start_of_last_lines(log, end, lines)
    except BaseException:
        log.close()
        raise
    return _chunks(log, start, end)


def _start_of_last_lines(log: IO[bytes], end: int, lines: int) -> int:
    """The offset where the last `lines` lines of the log's first `end` bytes begin; a final
    newline ends the last line rather than starting another."""
    found, position = 0, end
    while position > 0:
        size = min(TAIL_BLOCK_BYTES, position)
        position -= size
        log.seek(position)
        block = log.read(size)
        stop = len(block) - 1 if position + size == end and block.endswith(b"\n") else len(block)
        while (stop := block.rfind(b"\n", 0, stop)) >= 0:
            found += 1
            if found == lines:
                return position + stop + 1
    return 0


def _chunks(log: IO[bytes], start: int, end: int) -> Iterator[bytes]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with log:
        log.seek(start)
        left = end - start
        while left > 0:
            chunk = log.read(min(SEND_CHUNK_BYTES, left))
            if not chunk:  # truncated meanwhile
                break
            left -= len(chunk)
            yield decoder.decode(chunk).encode()
        yield decoder.decode(b"", final=True).encode()
