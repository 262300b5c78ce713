"""One scheduler per database: a lease row that the scheduling server renews.

A second `csx serve` on the same database used to take every RUNNING row for an orphan of a
crash and relaunch it while the first server still ran it, both writing one model folder. Now
the scheduler holds the row `scheduler_lease['scheduler']`: acquired at start, renewed while it
runs, released on a clean stop. Another server may take it only once it has expired, or at
once when its holder was a process of this host that no longer exists (a crash: its restart
need not wait out the lease). Every change is one conditional UPDATE on the holder it read, so
two servers starting together cannot both win.
"""

from __future__ import annotations

import os
import secrets
import socket
from datetime import UTC, datetime, timedelta

from sqlalchemy import insert, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.models import SchedulerLease
from service.processes import parent_of

LEASE_NAME = "scheduler"


class LeaseHeld(RuntimeError):
    """Another server schedules this database's jobs; the message names it."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


def new_holder() -> str:
    """`host:pid:random`: the random part tells two servers of one process (tests) apart."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def _local_pid(holder: str) -> int | None:
    """The process id of a holder of this host."""
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    return int(pid) if host == socket.gethostname() and pid.isdigit() else None


def _holder_is_gone(holder: str) -> bool:
    """A holder of this host whose process no longer exists."""
    pid = _local_pid(holder)
    return pid is not None and not os.path.exists(f"/proc/{pid}")


def is_sibling(holder: str) -> bool:
    """A holder that is another API process of this one's `csx serve` (uvicorn's workers
    share a parent)."""
    pid = _local_pid(holder)
    return pid is not None and pid != os.getpid() and parent_of(pid) == os.getppid()


def acquire(session: Session, holder: str, ttl_s: float) -> None:
    """Take the lease for `holder` or raise LeaseHeld; commits."""
    now = datetime.now(UTC)
    expires = now + timedelta(seconds=ttl_s)
    try:
        session.execute(insert(SchedulerLease).values(name=LEASE_NAME, holder=holder,
                                                      expires_at=expires))
        session.commit()
        return
    except IntegrityError:
        session.rollback()
    current = session.get(SchedulerLease, LEASE_NAME, populate_existing=True)
    if current is None:  # released between our insert and this read: try once more
        return acquire(session, holder, ttl_s)
    if current.holder != holder and current.expires_at > now \
            and not _holder_is_gone(current.holder):
        raise LeaseHeld(
            f"another csx server ({current.holder}) schedules the jobs of this database until "
            f"{current.expires_at:%Y-%m-%d %H:%M:%S} UTC; stop it, or point this one at "
            "another CSX_DATABASE_URL", current.holder)
    if not _swap(session, expected=current.holder, holder=holder, expires=expires):
        raise LeaseHeld("another csx server took the scheduler lease of this database "
                        "at the same moment", "")


def renew(session: Session, holder: str, ttl_s: float) -> bool:
    """Extend `holder`'s lease; False if it is no longer theirs. Commits."""
    return _swap(session, expected=holder, holder=holder,
                 expires=datetime.now(UTC) + timedelta(seconds=ttl_s))


def release(session: Session, holder: str) -> None:
    """Let the next server start at once; commits."""
    session.execute(update(SchedulerLease)
                    .where(SchedulerLease.name == LEASE_NAME, SchedulerLease.holder == holder)
                    .values(expires_at=datetime(1970, 1, 1, tzinfo=UTC)))
    session.commit()


def _swap(session: Session, *, expected: str, holder: str, expires: datetime) -> bool:
    result = session.execute(update(SchedulerLease)
                             .where(SchedulerLease.name == LEASE_NAME,
                                    SchedulerLease.holder == expected)
                             .values(holder=holder, expires_at=expires))
    session.commit()
    return result.rowcount == 1
