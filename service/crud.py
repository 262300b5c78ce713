"""Database reads and writes shared by routes, the scheduler and the CLI (keyword-only)."""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, func, insert, select
from sqlalchemy.engine import RowMapping
from sqlalchemy.orm import Session, defer, lazyload

from service.models import IdempotencyKey, Job, JobEvent, MlflowExperiment, Study, Token, utcnow
from service.states import HOLDING, TERMINAL, JobStatus

TOKEN_PREFIX = "csx_"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_token(session: Session, *, name: str, is_admin: bool = False) -> tuple[Token, str]:
    """Store a new token (or give a revoked one a new secret: its jobs stay its own); the
    secret is returned once and only its sha256 is kept."""
    token = session.scalar(select(Token).where(Token.name == name))
    if token is not None and token.revoked_at is None:
        raise ValueError(f"a token named {name!r} already exists")
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    if token is None:
        token = Token(name=name, token_hash=hash_secret(secret), is_admin=is_admin)
        session.add(token)
    else:
        token.token_hash, token.is_admin, token.revoked_at = hash_secret(secret), is_admin, None
    session.flush()
    return token, secret


def list_tokens(session: Session) -> list[Token]:
    return list(session.scalars(select(Token).order_by(Token.id)))


def revoke_token(session: Session, *, name: str) -> Token:
    """The token's secret stops authenticating (at once: requests look it up each time)."""
    token = session.scalar(select(Token).where(Token.name == name))
    if token is None:
        raise ValueError(f"no token named {name!r}")
    if token.revoked_at is None:
        token.revoked_at = utcnow()
    return token


def rotate_token(session: Session, *, name: str, is_admin: bool) -> str:
    """A new secret for token `name` (created if missing); the old secret stops working."""
    token = session.scalar(select(Token).where(Token.name == name))
    if token is None or token.revoked_at is not None:
        return create_token(session, name=name, is_admin=is_admin)[1]
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token.token_hash, token.is_admin = hash_secret(secret), is_admin
    return secret


@dataclass(frozen=True)
class Caller:
    """The token a request came with: a plain record, so a request loads no ORM instance."""

    id: int
    name: str
    is_admin: bool


# Statements run on every submission are built once, against the tables rather than the ORM
# classes, and run on the session's connection: building a statement, the ORM's per-row
# bookkeeping and Session.execute's own dispatch (half the time of these one-row statements)
# cost more than SQLite running them.
_JOBS, _EVENTS = Job.__table__, JobEvent.__table__
_CALLER_BY_HASH = select(Token.id, Token.name, Token.is_admin).where(
    Token.token_hash == bindparam("token_hash"), Token.revoked_at.is_(None))
_INSERT_JOB = insert(_JOBS).returning(*_JOBS.c)
_INSERT_EVENT = insert(_EVENTS)
# Two range counts on the (status, priority, id) index: one OR-ed condition scans every queued
# row instead.
_QUEUED_AHEAD = select(
    select(func.count()).select_from(_JOBS).where(
        _JOBS.c.status == JobStatus.QUEUED.value, _JOBS.c.priority > bindparam("priority"),
    ).scalar_subquery()
    + select(func.count()).select_from(_JOBS).where(
        _JOBS.c.status == JobStatus.QUEUED.value, _JOBS.c.priority == bindparam("priority"),
        _JOBS.c.id < bindparam("id"),
    ).scalar_subquery()
)

# Every queued job's place (priority first, then submission order), for a page of them.
_QUEUE_RANK = select(_JOBS.c.id, func.row_number().over(
    order_by=(_JOBS.c.priority.desc(), _JOBS.c.id)).label("position")).where(
    _JOBS.c.status == JobStatus.QUEUED.value).subquery()
_QUEUE_RANKS = select(_QUEUE_RANK.c.id, _QUEUE_RANK.c.position)


def get_caller(session: Session, *, secret: str) -> Caller | None:
    row = session.connection().execute(_CALLER_BY_HASH,
                                       {"token_hash": hash_secret(secret)}).first()
    return Caller(*row) if row is not None else None


def add_job(session: Session, *, owner: Caller, **fields: Any) -> RowMapping:
    """Insert a QUEUED job and its first event; `fields` are Job columns. Returns the job's row.

    Core INSERTs rather than a unit-of-work flush: the ORM's bookkeeping measured about two
    thirds of a submission's database time (bench/api_load.py)."""
    now = utcnow()
    # version=1: the ORM sets its optimistic-locking counter itself, a Core INSERT must.
    connection = session.connection()  # the session's transaction: commit/rollback cover it
    job = connection.execute(_INSERT_JOB, {
        "owner_id": owner.id, "status": JobStatus.QUEUED.value, "created_at": now,
        "attempt": 1, "version": 1, "run_key": secrets.token_hex(8), **fields}).mappings().one()
    connection.execute(_INSERT_EVENT, {
        "job_id": job["id"], "from_status": None, "to_status": job["status"],
        "message": "submitted", "attempt": 1, "at": now})
    return job


def queue_position(session: Session, *, job: Mapping[str, Any]) -> int | None:
    """1-based place among QUEUED jobs (priority first, then submission order); `job` holds
    the job's status, priority and id. Counts what the session's transaction holds without
    autoflushing it: ORM changes still pending in the session are not seen."""
    if job["status"] != JobStatus.QUEUED:
        return None
    ahead = session.connection().scalar(_QUEUED_AHEAD,
                                        {"priority": job["priority"], "id": job["id"]})
    return int(ahead or 0) + 1


def queue_positions(session: Session, *, jobs: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """queue_position of every QUEUED job among `jobs` (id → position), in one query however
    many are listed: each job's own counts cost a round trip apiece (a page of 20: most of
    its time)."""
    queued = [job["id"] for job in jobs if job["status"] == JobStatus.QUEUED]
    if not queued:
        return {}
    rows = session.connection().execute(_QUEUE_RANKS.where(_QUEUE_RANK.c.id.in_(queued)))
    return {job_id: int(position) for job_id, position in rows}


def queue_head(session: Session, *, max_systems: int) -> Job | None:
    """The QUEUED job that starts next among those needing at most `max_systems` (one indexed
    row, however long the queue)."""
    return session.scalars(
        select(Job).where(Job.status == JobStatus.QUEUED.value, Job.num_csx <= max_systems)
        .order_by(Job.priority.desc(), Job.id).limit(1)
    ).first()


def queued_count(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Job)
                              .where(Job.status == JobStatus.QUEUED.value)) or 0)


# What the scheduler's every tick and /cluster read of the jobs holding systems: their params
# (a tick reads each one's CPUs and GPUs) but not their other JSON documents or owner, which
# load only where an attribute is read. Parsing them took most of an idle server's CPU.
_STATE_ONLY = (lazyload(Job.owner), defer(Job.plan), defer(Job.result), defer(Job.progress),
               defer(Job.tags))


def jobs_in(session: Session, *, statuses: frozenset[JobStatus]) -> list[Job]:
    return list(session.scalars(
        select(Job).where(Job.status.in_([s.value for s in statuses])).order_by(Job.id)
        .options(*_STATE_ONLY)
    ))


def held_systems(session: Session) -> dict[int, int]:
    """CS-2 id → id of the job holding it."""
    return {system: job.id for job in jobs_in(session, statuses=HOLDING) for system in job.systems}


def list_jobs(
    session: Session,
    *,
    owner: Caller,
    limit: int,
    cursor: int | None = None,
    status: JobStatus | None = None,
    experiment: str | None = None,
    owner_name: str | None = None,
) -> tuple[list[Job], int | None]:
    """Newest first; a non-admin sees only their own jobs. `cursor`: only jobs older than the
    job with that id (the last id of the previous page); any id is a valid cursor."""
    # A listing shows no params or plan: their JSON is not read (most of a page's time).
    query = (select(Job).order_by(Job.id.desc()).limit(limit + 1)
             .options(defer(Job.params), defer(Job.plan)))
    if not owner.is_admin:
        query = query.where(Job.owner_id == owner.id)
    if owner_name is not None:
        query = query.join(Token, Job.owner_id == Token.id).where(Token.name == owner_name)
    if cursor is not None:
        query = query.where(Job.id < cursor)
    if status is not None:
        query = query.where(Job.status == status.value)
    if experiment is not None:
        query = query.where(Job.experiment == experiment)
    jobs = list(session.scalars(query).unique())
    next_cursor = jobs[limit - 1].id if len(jobs) > limit else None
    return jobs[:limit], next_cursor


def request_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def find_idempotency_key(session: Session, *, owner: Caller, key: str) -> IdempotencyKey | None:
    return session.scalar(
        select(IdempotencyKey).where(IdempotencyKey.owner_id == owner.id, IdempotencyKey.key == key)
    )


def add_study(session: Session, *, owner: Caller, name: str, experiment: str,
              request: dict[str, Any]) -> Study:
    study = Study(owner_id=owner.id, name=name, experiment=experiment, request=request,
                  created_at=utcnow())
    session.add(study)
    session.flush()
    return study


def studies_to_report(session: Session) -> list[Study]:
    """Studies with a parent run whose report is not logged yet and whose jobs all ended."""
    unfinished = select(Job.id).where(Job.study_id == Study.id,
                                      Job.status.not_in([s.value for s in TERMINAL]))
    return list(session.scalars(select(Study).where(
        Study.report_logged.is_(False), Study.mlflow_run_id.is_not(None), ~unfinished.exists())))


def mlflow_experiment_ids(session: Session, *, owner: Caller) -> list[str]:
    """The MLflow experiments the service made for the caller's jobs and studies."""
    return sorted(session.scalars(select(MlflowExperiment.mlflow_experiment_id).where(
        MlflowExperiment.owner_id == owner.id)))


def user_count(session: Session) -> int:
    return session.scalar(select(func.count()).select_from(Token)) or 0
