"""Database reads and writes shared by routes, the scheduler and the CLI (keyword-only)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import secrets
from typing import Any

from sqlalchemy import and_, bindparam, func, insert, or_, select
from sqlalchemy.orm import Session

from service.models import IdempotencyKey, Job, JobEvent, Study, Token, utcnow
from service.states import HOLDING, JobStatus

TOKEN_PREFIX = "csx_"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_token(session: Session, *, name: str, is_admin: bool = False) -> tuple[Token, str]:
    """Store a new token; the secret is returned once and only its sha256 is kept."""
    if session.scalar(select(Token).where(Token.name == name)) is not None:
        raise ValueError(f"a token named {name!r} already exists")
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = Token(name=name, token_hash=hash_secret(secret), is_admin=is_admin)
    session.add(token)
    session.flush()
    return token, secret


def rotate_token(session: Session, *, name: str, is_admin: bool) -> str:
    """A new secret for token `name` (created if missing); the old secret stops working."""
    token = session.scalar(select(Token).where(Token.name == name))
    if token is None:
        return create_token(session, name=name, is_admin=is_admin)[1]
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token.token_hash, token.is_admin = hash_secret(secret), is_admin
    return secret


# Statements run on every request are built once: building one costs more than running it.
_TOKEN_BY_HASH = select(Token).where(Token.token_hash == bindparam("token_hash"))
_QUEUED_AHEAD = select(func.count()).select_from(Job).where(
    Job.status == JobStatus.QUEUED.value,
    or_(Job.priority > bindparam("priority"),
        and_(Job.priority == bindparam("priority"), Job.id < bindparam("id"))),
)


def get_token_by_secret(session: Session, *, secret: str) -> Token | None:
    return session.scalar(_TOKEN_BY_HASH, {"token_hash": hash_secret(secret)})


def add_job(session: Session, *, owner: Token, **fields: Any) -> Job:
    """Insert a QUEUED job and its first event; `fields` are Job columns.

    Two INSERT statements rather than a unit-of-work flush: the flush's bookkeeping measured
    about a third of a submission's CPU time (bench/api_load.py)."""
    now = utcnow()
    job = session.scalars(insert(Job).returning(Job), [{
        "owner_id": owner.id, "status": JobStatus.QUEUED.value, "created_at": now,
        "attempt": 1, **fields}]).one()
    session.execute(insert(JobEvent), [{
        "job_id": job.id, "from_status": None, "to_status": job.status, "message": "submitted",
        "attempt": 1, "at": now}])
    return job


def queue_position(session: Session, *, job: Job) -> int | None:
    """1-based place among QUEUED jobs (priority first, then submission order)."""
    if job.status != JobStatus.QUEUED:
        return None
    ahead = session.scalar(_QUEUED_AHEAD, {"priority": job.priority, "id": job.id})
    return int(ahead or 0) + 1


def queue_head(session: Session) -> Job | None:
    """The QUEUED job that starts next (one indexed row, however long the queue)."""
    return session.scalars(
        select(Job).where(Job.status == JobStatus.QUEUED.value)
        .order_by(Job.priority.desc(), Job.id).limit(1)
    ).first()


def queued_count(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Job)
                              .where(Job.status == JobStatus.QUEUED.value)) or 0)


def jobs_in(session: Session, *, statuses: frozenset[JobStatus]) -> list[Job]:
    return list(session.scalars(
        select(Job).where(Job.status.in_([s.value for s in statuses])).order_by(Job.id)
    ))


def held_systems(session: Session) -> dict[int, int]:
    """CS-2 id → id of the job holding it."""
    return {system: job.id for job in jobs_in(session, statuses=HOLDING) for system in job.systems}


def encode_cursor(last_id: int) -> str:
    return base64.urlsafe_b64encode(json.dumps({"before": last_id}).encode()).decode()


def decode_cursor(cursor: str) -> int:
    try:
        before = json.loads(base64.urlsafe_b64decode(cursor.encode()))["before"]
    except (binascii.Error, ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise ValueError("cursor is not one returned by GET /v1/jobs") from None
    if not isinstance(before, int):
        raise ValueError("cursor is not one returned by GET /v1/jobs")
    return before


def list_jobs(
    session: Session,
    *,
    owner: Token,
    limit: int,
    cursor: str | None = None,
    status: JobStatus | None = None,
    experiment: str | None = None,
    owner_name: str | None = None,
) -> tuple[list[Job], str | None]:
    """Newest first; a non-admin sees only their own jobs."""
    query = select(Job).order_by(Job.id.desc()).limit(limit + 1)
    if not owner.is_admin:
        query = query.where(Job.owner_id == owner.id)
    if owner_name is not None:
        query = query.join(Token, Job.owner_id == Token.id).where(Token.name == owner_name)
    if cursor is not None:
        query = query.where(Job.id < decode_cursor(cursor))
    if status is not None:
        query = query.where(Job.status == status.value)
    if experiment is not None:
        query = query.where(Job.experiment == experiment)
    jobs = list(session.scalars(query).unique())
    next_cursor = encode_cursor(jobs[limit - 1].id) if len(jobs) > limit else None
    return jobs[:limit], next_cursor


def request_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def find_idempotency_key(session: Session, *, owner: Token, key: str) -> IdempotencyKey | None:
    return session.scalar(
        select(IdempotencyKey).where(IdempotencyKey.owner_id == owner.id, IdempotencyKey.key == key)
    )


def add_study(session: Session, *, owner: Token, name: str, experiment: str,
              request: dict[str, Any]) -> Study:
    study = Study(owner_id=owner.id, name=name, experiment=experiment, request=request,
                  created_at=utcnow())
    session.add(study)
    session.flush()
    return study
