"""Queue → simulated CS-2 cluster: priority then FIFO, a job holds num_csx systems until it ends.

One scheduler thread ticks every `scheduler_interval_s` (and on `wake()`): it hands free
systems to the head of the queue, forwards cancels and timeouts to running jobs, and leaves
everything else to one execution thread per job, which validates, launches the worker group
through `workers.runner.start_job`, follows its progress and records the outcome. Every state
change goes through `states.move`. On start, `recover()` makes a restart lose nothing:
QUEUED jobs wait, jobs that held systems resume from their last checkpoint as RECOVERING.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.exc import StaleDataError

from service import crud, joblogs
from service.jobs import memory_problems
from service.models import Job
from service.settings import Settings
from service.states import RESUMABLE, TERMINAL, JobStatus, move

logger = logging.getLogger(__name__)
S = JobStatus


class Handle(Protocol):
    """What `workers.runner.start_job` returns."""

    run_id: str | None

    def cancel(self) -> None: ...
    def wait(self) -> dict[str, Any]: ...


Launcher = Callable[..., Handle]  # start_job's keyword signature


class RayLauncher:
    """start_job on a Ray runtime sized for the whole cluster: RAY_ADDRESS's, else a local head
    this launcher starts as a supervised child on the first launch (service/supervised.py says
    why not ray.init in a thread) and stops on `close()`."""

    def __init__(self, settings: Settings) -> None:
        from service.cluster import LiveCluster

        self.cluster_size = settings.cluster_size
        self.runs_dir = settings.runs_dir
        self._head: Any = None
        self._lock = threading.Lock()
        # Capacity: the live cluster's csx resource (service/cluster.py); before the local head
        # starts, what it will declare.
        self.cluster = LiveCluster(self._planned_cluster)
        settings.read_cluster_from(self.cluster.summary)

    def _planned_cluster(self) -> Any:
        """Not connected yet: RAY_ADDRESS's cluster is joined (as a driver) to be read; the
        local head is what it will declare."""
        from service.cluster import live_summary, machine_summary
        from workers.runner import connect_ray

        address = os.environ.get("RAY_ADDRESS")
        if not address:
            return machine_summary(self.cluster_size)
        with self._lock:
            connect_ray(systems=machine_summary(self.cluster_size).systems, address=address)
        return live_summary()

    def __call__(self, spec: Any, **kwargs: Any) -> Handle:
        import ray

        from service.cluster import machine_summary
        from workers.runner import connect_ray, start_job

        systems = machine_summary(self.cluster_size).systems
        with self._lock:
            address = os.environ.get("RAY_ADDRESS")
            if not address and not ray.is_initialized():
                if self._head is None:
                    from service.supervised import RayHead

                    self._head = RayHead(systems=systems,
                                         log_path=self.runs_dir / "ray" / "head.log")
                address = self._head.address
            connect_ray(systems=systems, address=address)
        return start_job(spec, **kwargs)

    def close(self) -> None:
        with self._lock:
            if self._head is not None:
                import ray

                ray.shutdown()
                self._head.close()
                self._head = None


@dataclass
class Execution:
    job_id: int
    folder: Path  # the job's folder: its log, model and checkpoints
    handle: Handle | None = None
    stop_reason: str | None = None  # why the scheduler stopped it: "cancelled" or "timeout"
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stop(self, reason: str) -> None:
        with self.lock:
            if self.stop_reason is None:
                self.stop_reason = reason
            handle = self.handle
        if handle is not None:
            handle.cancel()

    def attach(self, handle: Handle) -> None:
        with self.lock:
            self.handle = handle
            stopped = self.stop_reason is not None
        if stopped:
            handle.cancel()


class Scheduler:
    def __init__(self, settings: Settings, sessions: sessionmaker[Session],
                 launcher: Launcher | None = None) -> None:
        self.settings = settings
        self.sessions = sessions
        self.launcher = launcher or RayLauncher(settings)
        self._executions: dict[int, Execution] = {}
        self._executions_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self.recover()
        self._thread = threading.Thread(target=self._loop, name="csx-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        close = getattr(self.launcher, "close", None)
        if close is not None:
            close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wake(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.tick()
            except Exception:
                # One bad tick (say, the database briefly away) must not end scheduling.
                logger.exception("scheduler tick failed; retrying next tick")
            # Wakes that arrive during a tick or the gap after it are served by one next tick,
            # so a burst of submissions costs a few ticks instead of one each.
            self._stopping.wait(self.settings.scheduler_min_gap_s)
            self._wake.wait(self.settings.scheduler_interval_s)
            self._wake.clear()

    def recover(self) -> None:
        """After a restart: nothing is running in this process yet, whatever the rows say."""
        resume = []
        with self.sessions() as session:
            for job in crud.jobs_in(session, statuses=frozenset(S) - TERMINAL - {S.QUEUED}):
                status = JobStatus(job.status)
                if status is S.VALIDATING:
                    self._move(session, job, S.QUEUED, "service restarted during validation")
                elif status is S.CANCELLING:
                    self._move(session, job, S.CANCELLED, "cancelled (service restarted)")
                elif status in RESUMABLE:
                    if status is not S.RECOVERING:
                        self._move(session, job, S.RECOVERING,
                                   "service restarted; resuming from the last checkpoint")
                    resume.append(job)
            session.commit()
        # Only after the commit: an execution thread must read RECOVERING, not the old state.
        for job in resume:
            execution = self._spawn(job, resume=True)
            joblogs.append(execution.folder, "resuming after restart")

    # ---- one pass --------------------------------------------------------------------------
    def tick(self) -> None:
        with self.sessions() as session:
            self._forward_stops(session)
            if not self.settings.paused:
                self._start_queued(session)

    def _forward_stops(self, session: Session) -> None:
        now = datetime.now(UTC)
        for job in crud.jobs_in(session, statuses=frozenset({S.CANCELLING, S.RUNNING,
                                                             S.RECOVERING})):
            execution = self._executions.get(job.id)
            if job.status == S.CANCELLING:
                if execution is not None:
                    execution.stop("cancelled")
                else:
                    self._move(session, job, S.CANCELLED, "cancelled")
                    session.commit()
            elif (execution is not None and job.timeout_s is not None
                  and job.started_at is not None
                  and (now - job.started_at).total_seconds() > job.timeout_s):
                execution.stop("timeout")

    def _start_queued(self, session: Session) -> None:
        free = sorted(set(range(self.settings.systems)) - set(crud.held_systems(session)))
        # Strict priority + FIFO: the head waits for its systems; nobody overtakes it. Only the
        # head is read, so a tick costs one indexed row however long the queue is.
        while (job := crud.queue_head(session)) is not None and job.num_csx <= len(free):
            job.systems, free = free[:job.num_csx], free[job.num_csx:]
            self._move(session, job, S.VALIDATING, f"systems {job.systems} reserved")
            session.commit()
            self._spawn(job, resume=False)

    # ---- execution threads -----------------------------------------------------------------
    def _spawn(self, job: Job, *, resume: bool) -> Execution:
        execution = Execution(job.id, joblogs.job_dir(self.settings.runs_dir, job.id,
                                                      job.run_key))
        with self._executions_lock:
            self._executions[job.id] = execution
        threading.Thread(target=self._execute, args=(execution, resume),
                         name=f"csx-job-{job.id}", daemon=True).start()
        return execution

    def _execute(self, execution: Execution, resume: bool) -> None:
        job_id = execution.job_id
        try:
            spec, launch_args = self._prepare(execution, resume)
            if execution.stop_reason is None:
                handle = self.launcher(spec, **launch_args)
                execution.attach(handle)
                self._started(job_id, handle)
                result = handle.wait()
                self._finish(job_id, execution, S.SUCCEEDED, "finished", result=result)
            else:
                self._finish(job_id, execution, S.FAILED, "stopped before launch")
        except Exception as err:
            # The job boundary: whatever went wrong becomes the job's FAILED reason (one line,
            # for users) and, with its traceback, the job's log.
            joblogs.append(execution.folder, traceback.format_exc())
            self._finish(job_id, execution, S.FAILED,
                         user_reason(err, self.settings.runs_dir, job_id))
        finally:
            with self._executions_lock:
                self._executions.pop(job_id, None)
            self.wake()

    def _prepare(self, execution: Execution, resume: bool) -> tuple[Any, dict[str, Any]]:
        """VALIDATING → PROVISIONING (deep validation, with torch), or resume as is."""
        from csx_config import JobSpec

        job_id = execution.job_id
        with self.sessions() as session:
            job = self._load(session, job_id)
            spec = JobSpec.model_validate(job.params)
            if not resume:
                # Admission again: a job queued before the limit (or this check) existed.
                too_big = memory_problems(spec, job.num_csx, self.settings)
                if too_big:
                    raise ValueError(f"invalid job: {too_big[0][1]}")
                try:
                    from workers.plan import validate_plan

                    job.plan = json.loads(json.dumps(validate_plan(spec, job.num_csx),
                                                     default=str))
                except (ValueError, TypeError) as err:
                    raise ValueError(f"invalid job: {err}") from err
                ignored = job.plan.get("not_applied") or []
                note = f"; not applied here (hardware-only keys): {', '.join(ignored)}" if ignored else ""
                self._move(session, job, S.PROVISIONING, f"plan validated{note}")
            model_dir = execution.folder / "model"
            from service.studies import run_identity

            run_name, run_tags = run_identity(job)  # MLflow run name and csx.* tags
            launch_args = {
                "num_csx": job.num_csx, "mode": job.mode, "model_dir": str(model_dir),
                "mlflow_run_id": job.mlflow_run_id, "experiment": job.experiment,
                "parent_run_id": job.study.mlflow_run_id if job.study else None,
                "progress": lambda event: self._on_progress(execution, event),
                "max_failures": job.max_failures,
                "tracking_uri": self.settings.mlflow_tracking_uri,
                "run_name": run_name, "tags": run_tags,
            }
            session.commit()
        return spec, launch_args

    def _started(self, job_id: int, handle: Handle) -> None:
        def apply(session: Session, job: Job) -> None:
            if handle.run_id and job.mlflow_run_id != handle.run_id:
                job.mlflow_run_id = handle.run_id
                job.mlflow_experiment_id = _experiment_id(self.settings, handle.run_id)
            if job.status in (S.PROVISIONING, S.RECOVERING):
                self._move(session, job, S.RUNNING, f"worker group of {job.num_csx} started")

        self._apply(job_id, apply)

    def _on_progress(self, execution: Execution, event: dict[str, Any]) -> None:
        event = json.loads(json.dumps(event, default=str))
        joblogs.append(execution.folder, json.dumps(event))

        def apply(session: Session, job: Job) -> None:
            if event.get("event") == "recovering":
                job.failures = int(event.get("failures", job.failures + 1))
                if job.status == S.RUNNING:
                    error = one_line(str(event.get("error")), self.settings.runs_dir)
                    self._move(session, job, S.RECOVERING, f"worker lost: {error}")
                return
            job.progress = event
            if job.status == S.RECOVERING:
                self._move(session, job, S.RUNNING, "worker group back")

        self._apply(execution.job_id, apply)

    def _finish(self, job_id: int, execution: Execution, outcome: JobStatus, message: str,
                result: dict[str, Any] | None = None) -> None:
        if execution.stop_reason == "timeout":
            outcome, message = S.FAILED, "TIMEOUT: the job ran longer than its timeout_s"
        elif execution.stop_reason == "cancelled":
            outcome, message = S.CANCELLED, "cancelled"

        def apply(session: Session, job: Job) -> None:
            if job.status in TERMINAL:
                return
            if result is not None:
                job.result = json.loads(json.dumps(result, default=str))
            target = outcome
            if job.status == S.CANCELLING:
                target = S.CANCELLED
            elif target is S.CANCELLED:
                self._move(session, job, S.CANCELLING, message)
            if target is S.SUCCEEDED and job.status != S.RUNNING:
                self._move(session, job, S.RUNNING, "resumed")
            self._move(session, job, target, message)

        joblogs.append(execution.folder, f"{outcome.value}: {message}")
        self._apply(job_id, apply)

    # ---- helpers ---------------------------------------------------------------------------
    def _apply(self, job_id: int, change: Callable[[Session, Job], None], tries: int = 5) -> None:
        """Run `change` on a fresh copy of the job and commit; redo it if the API moved the job
        in between (optimistic locking), so a decision is never based on a stale state."""
        for attempt in range(tries):
            with self.sessions() as session:
                change(session, self._load(session, job_id))
                try:
                    session.commit()
                    return
                except StaleDataError:
                    session.rollback()
                    if attempt == tries - 1:
                        raise

    def _move(self, session: Session, job: Job, target: JobStatus, message: str) -> None:
        move(session, job, target, message=message,
             mlflow_tracking_uri=self.settings.mlflow_tracking_uri)

    @staticmethod
    def _load(session: Session, job_id: int) -> Job:
        job = session.get(Job, job_id)
        if job is None:
            raise LookupError(f"job {job_id} vanished from the database")
        return job


MAX_REASON_CHARS = 300
_ABSOLUTE_PATH = re.compile(r"(?<![\w.])/(?:[^\s'\"/:]+/)+([^\s'\"/:]+)")


def user_reason(err: BaseException, runs_dir: Path, job_id: int) -> str:
    """One line for a job's status_message: the error's type and the last line of its message
    (Ray wraps a worker's exception in a traceback), paths shown relative to the runs folder or
    by their last part only; the full story is in the job's log."""
    cause = getattr(err, "cause", None)  # a RayTaskError's original exception
    if isinstance(cause, BaseException):
        err = cause
    text = one_line(str(err), runs_dir)
    reason = f"{type(err).__name__}: {text}" if text else type(err).__name__
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[:MAX_REASON_CHARS - 3] + "..."
    return f"{reason} (details: GET /v1/jobs/{job_id}/logs)"


def one_line(message: str, runs_dir: Path) -> str:
    """The last non-empty line of `message` (a traceback's is the error itself), with paths
    under `runs_dir` as runs/... and any other absolute path cut to its last part."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    text = text.replace(str(runs_dir) + "/", "runs/")
    return _ABSOLUTE_PATH.sub(lambda m: ".../" + m.group(1), text)[:MAX_REASON_CHARS]


def _experiment_id(settings: Settings, run_id: str) -> str:
    from mlflow.tracking import MlflowClient

    return MlflowClient(settings.mlflow_tracking_uri).get_run(run_id).info.experiment_id
