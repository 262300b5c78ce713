"""Job states, the transition table, and the one function that moves a job.

QUEUED → VALIDATING → PROVISIONING → RUNNING ⇄ RECOVERING → SUCCEEDED | FAILED | CANCELLING →
CANCELLED. SUCCEEDED and CANCELLED accept nothing; FAILED accepts only the explicit retry back to
QUEUED (same job, same MLflow run, attempt + 1). RECOVERING goes back to QUEUED when the node
its workers waited for left the cluster (service/scheduler.py): same attempt, systems freed.
Every move writes a JobEvent row and, when the job has an MLflow run, queues its `csx.status`
tag (service/run_tags.py: never waits on MLflow).
"""

from __future__ import annotations

from enum import StrEnum

from sqlalchemy.orm import Session

from service import run_tags
from service.models import Job, JobEvent, utcnow


class JobStatus(StrEnum):
    QUEUED = "QUEUED"
    VALIDATING = "VALIDATING"
    PROVISIONING = "PROVISIONING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLING = "CANCELLING"
    CANCELLED = "CANCELLED"


S = JobStatus
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    S.QUEUED: frozenset({S.VALIDATING, S.CANCELLED}),
    # VALIDATING → QUEUED only when the service restarts mid-validation: nothing ran yet.
    S.VALIDATING: frozenset({S.PROVISIONING, S.FAILED, S.CANCELLING, S.QUEUED}),
    S.PROVISIONING: frozenset({S.RUNNING, S.RECOVERING, S.FAILED, S.CANCELLING}),
    S.RUNNING: frozenset({S.RECOVERING, S.SUCCEEDED, S.FAILED, S.CANCELLING}),
    S.RECOVERING: frozenset({S.RUNNING, S.FAILED, S.CANCELLING, S.QUEUED}),
    S.CANCELLING: frozenset({S.CANCELLED}),
    S.FAILED: frozenset({S.QUEUED}),
    S.SUCCEEDED: frozenset(),
    S.CANCELLED: frozenset(),
}
TERMINAL = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})
# States in which a job holds CS-2 systems (it got them when validation began).
HOLDING = frozenset({S.VALIDATING, S.PROVISIONING, S.RUNNING, S.RECOVERING, S.CANCELLING})
# States whose worker must be relaunched from the last checkpoint after a service restart.
RESUMABLE = frozenset({S.PROVISIONING, S.RUNNING, S.RECOVERING})


class IllegalTransition(Exception):
    """A move the table forbids; the API answers 409 with this message."""

    def __init__(self, job_id: int, current: str, target: str) -> None:
        allowed = ", ".join(sorted(TRANSITIONS[JobStatus(current)])) or "none (terminal)"
        super().__init__(
            f"job {job_id} cannot go from {current} to {target}; allowed from {current}: {allowed}"
        )


def move(
    session: Session,
    job: Job,
    target: JobStatus,
    *,
    message: str | None = None,
    mlflow_tracking_uri: str | None = None,
) -> JobEvent:
    """Move `job` to `target`, stamp its times, add the event row; the caller commits."""
    current = JobStatus(job.status)
    if target not in TRANSITIONS[current]:
        raise IllegalTransition(job.id, current, target)
    now = utcnow()
    if target is S.QUEUED and current is S.FAILED:
        job.attempt += 1
        job.failures = 0
        job.finished_at = None
        job.result = None
    if target is S.QUEUED:
        job.started_at = None  # the timeout counts from the start that follows
    if target is S.RUNNING and job.started_at is None:
        job.started_at = now
    if target in TERMINAL:
        job.finished_at = now
    if target in TERMINAL or target is S.QUEUED:
        job.systems = []
    job.status = target.value
    job.status_message = message
    event = JobEvent(
        job_id=job.id, from_status=current.value, to_status=target.value,
        message=message, attempt=job.attempt, at=now,
    )
    session.add(event)
    if job.mlflow_run_id and mlflow_tracking_uri:
        tags = {"csx.status": target.value}
        if message:
            tags["csx.status_message"] = message[:5000]
        run_tags.submit(mlflow_tracking_uri, job.mlflow_run_id, tags)
    return event
