"""SQLAlchemy 2 tables typed with Mapped; pydantic schemas with the same names live in schemas.py."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC on the way out on every backend (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to a UTCDateTime column")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    pass


class Token(Base):
    __tablename__ = "tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the secret
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # `csx token revoke`: the secret stops working; the row stays, its jobs keep their owner.
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Study(Base):
    __tablename__ = "studies"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("tokens.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    experiment: Mapped[str] = mapped_column(String(200))
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    mlflow_experiment_id: Mapped[str | None] = mapped_column(String(64))
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    # Its report went to its parent run (the scheduler logs it once every job ended).
    report_logged: Mapped[bool] = mapped_column(Boolean, default=False, index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    owner: Mapped[Token] = relationship(lazy="joined")
    jobs: Mapped[list[Job]] = relationship(back_populates="study", order_by="Job.id")


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_status_priority", "status", "priority", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    # Optimistic locking: the API and the scheduler thread both move jobs; a move based on a
    # stale read fails with StaleDataError instead of overwriting, say, a terminal state.
    __mapper_args__ = {"version_id_col": version}  # noqa: RUF012
    owner_id: Mapped[int] = mapped_column(ForeignKey("tokens.id"), index=True)
    study_id: Mapped[int | None] = mapped_column(ForeignKey("studies.id"), index=True)
    name: Mapped[str] = mapped_column(Text)  # a study's: "<study>/<variant>[/seed<N>]"
    experiment: Mapped[str] = mapped_column(String(200), index=True)
    status: Mapped[str] = mapped_column(String(20), index=True)
    # In the job's folder name (joblogs.job_dir): random, so a folder left by another database
    # (ids start at 1 again) is never this job's. NULL for jobs from before it existed.
    run_key: Mapped[str | None] = mapped_column(String(32))
    status_message: Mapped[str | None] = mapped_column(Text)
    mode: Mapped[str] = mapped_column(String(20))
    num_csx: Mapped[int] = mapped_column(Integer)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    max_failures: Mapped[int] = mapped_column(Integer, default=0)
    failures: Mapped[int] = mapped_column(Integer, default=0)
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    timeout_s: Mapped[float | None] = mapped_column()
    tags: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    systems: Mapped[list[int]] = mapped_column(JSON, default=list)  # CS-2 ids held right now
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    mlflow_experiment_id: Mapped[str | None] = mapped_column(String(64))
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    owner: Mapped[Token] = relationship(lazy="joined")
    study: Mapped[Study | None] = relationship(back_populates="jobs")
    events: Mapped[list[JobEvent]] = relationship(
        back_populates="job", order_by="JobEvent.id", cascade="all, delete-orphan"
    )


class JobEvent(Base):
    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    from_status: Mapped[str | None] = mapped_column(String(20))
    to_status: Mapped[str] = mapped_column(String(20))
    message: Mapped[str | None] = mapped_column(Text)
    attempt: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    job: Mapped[Job] = relationship(back_populates="events")


def owner_name(row: Job | Study) -> str:
    """The name of the token that owns a job or study; a token row deleted by hand (before
    `csx token revoke` existed) leaves only its id, and an admin's listing must still answer."""
    return row.owner.name if row.owner is not None else f"(removed user {row.owner_id})"


class IdempotencyKey(Base):
    __tablename__ = "idempotency_keys"
    __table_args__ = (UniqueConstraint("owner_id", "key", name="uq_idempotency_owner_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("tokens.id"))
    key: Mapped[str] = mapped_column(String(255))
    request_hash: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"))
    response: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class MlflowExperiment(Base):
    """An MLflow experiment the service created for one user's experiment name
    (service/experiments.py): the only experiments its jobs and studies log to."""

    __tablename__ = "mlflow_experiments"
    __table_args__ = (UniqueConstraint("owner_id", "name", name="uq_mlflow_experiment_owner_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("tokens.id"))
    name: Mapped[str] = mapped_column(String(200))  # the user's name, as jobs and studies give it
    mlflow_name: Mapped[str] = mapped_column(String(256))  # what MLflow calls it
    mlflow_experiment_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class SchedulerLease(Base):
    """Which server schedules this database's jobs (service/lease.py): one row, renewed."""

    __tablename__ = "scheduler_lease"

    name: Mapped[str] = mapped_column(String(50), primary_key=True)
    holder: Mapped[str] = mapped_column(String(200))
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
