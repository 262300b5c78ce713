"""Queue → simulated CS-2 cluster: priority then FIFO, a job holds num_csx systems until it ends.

One scheduler thread ticks every `scheduler_interval_s` (and on `wake()`): it hands free
systems to the head of the queue, forwards cancels and timeouts to running jobs, and leaves
everything else to one execution thread per job, which makes the job's plan (training/plan.py),
launches its worker group (service/launcher.py: `workers.runner.start_job`), follows its
progress and records the outcome. Every state
change goes through `states.move`.

Nothing is lost and nothing is stranded:
- One scheduler per database (service/lease.py): a server whose database another server
  schedules serves the API but stands by, and takes over (resuming that server's jobs) only
  once its lease expires; a server that finds its own lease taken stops its worker groups
  without recording anything and stands by.
- A database write that fails is retried (`_apply`); an outcome that still could not be
  written stays with its execution and every tick tries it again.
- Every tick reconciles: a job that holds systems but has no execution here (a thread that
  died, a restart) is adopted again, resuming from its last checkpoint, so its timeout and
  cancel act on it; on start this is what makes a restart lose nothing.
- `stop()` (SIGTERM) stops the worker groups but records nothing: their jobs stay resumable
  and the next start resumes them.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.exc import StaleDataError

from service import crud, joblogs, lease, run_tags
from service.checkpoints import remove_unfinished_writes
from service.experiments import find_run, owned_experiment_id
from service.jobs import memory_problems
from service.launcher import Handle, Launcher, RayLauncher
from service.mlflow_auth import experiment_name
from service.models import Job, Study, owner_name
from service.settings import Settings
from service.states import HOLDING, RESUMABLE, TERMINAL, JobStatus, move
from service.study_reports import log_to_parent_run
from tracking.server import MLFLOW_AWAY, MLFLOW_BACK, mlflow_unreachable
from workers.hardware import ClusterSummary, job_footprint

logger = logging.getLogger(__name__)
S = JobStatus
# The database being away (down, restarting, pool exhausted): worth waiting for.
DATABASE_UNAVAILABLE = (OperationalError, InterfaceError, PoolTimeoutError)
# How long a job thread keeps retrying one database write before it gives up on it.
DATABASE_RETRY_S = 60.0
SHUTDOWN = "shutdown"  # Execution.stop_reason when the service stops: leave the job resumable
REQUEUE = "requeue"  # ... when its systems left the cluster: back to the queue, resumable
# A job's workers die with the Ray head a moment before the head's watcher notices.
CLUSTER_LOSS_GRACE_S = 3.0
REPORT_FLUSH_S = 15.0  # how long a stop waits for finished studies' reports to reach MLflow
MLFLOW_POLL_S = 5.0  # how often a job waiting for its MLflow server asks it again


@dataclass
class Execution:
    job_id: int
    folder: Path  # the job's folder: its log, model and checkpoints
    handle: Handle | None = None
    # Why the scheduler stopped it: "cancelled", "timeout", SHUTDOWN or REQUEUE.
    stop_reason: str | None = None
    # (status, message, result) once the job ended, until the database has recorded it.
    outcome: tuple[JobStatus, str, dict[str, Any] | None] | None = None
    thread: threading.Thread | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopped: threading.Event = field(default_factory=threading.Event)  # set with stop_reason
    # While the job's status message says why it waits for MLflow: (that message, the one it
    # replaced, put back once the server answers).
    mlflow_wait: tuple[str, str | None] | None = None

    def stop(self, reason: str) -> None:
        with self.lock:
            if self.stop_reason is None:
                self.stop_reason = reason
            handle = self.handle
        self.stopped.set()
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
        if launcher is None:
            launcher = RayLauncher(settings)
        self.launcher = launcher
        self._executions: dict[int, Execution] = {}
        self._executions_lock = threading.Lock()
        self._parent_runs_lock = threading.Lock()
        self._reporting: set[int] = set()  # studies whose report write is queued
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.holder = lease.new_holder()
        self._lease_checked = 0.0  # time.monotonic() of the last renewal or takeover attempt
        self.standby: str | None = None  # why this server does not schedule: the holder
        self._standby_holder = ""  # and that holder's id
        # time.monotonic() of the last complete tick, or of the start: a server whose first
        # tick has not ended yet is as fresh as one that has just ticked.
        self.last_tick_ok = time.monotonic()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Take the database's scheduler lease and resume what a previous server left, or stand
        by if another server holds it; then tick."""
        if self._take_lease():
            self.recover()
        self.last_tick_ok = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="csx-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0, drain_s: float = 60.0) -> None:
        """Stop scheduling and every worker group, leaving their jobs as they are (resumable
        from their last checkpoint at the next start), then Ray, then the lease."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._executions_lock:
            executions = list(self._executions.values())
        for execution in executions:
            execution.stop(SHUTDOWN)
        deadline = time.monotonic() + drain_s
        for execution in executions:
            if execution.thread is not None:
                execution.thread.join(max(0.0, deadline - time.monotonic()))
        if self.standby is None:
            self._log_due_reports(REPORT_FLUSH_S)
        # Only now: a job thread still calling Ray after ray.shutdown() would start or join
        # some other Ray runtime of this machine.
        close = getattr(self.launcher, "close", None)
        if close is not None:
            close()
        if self.standby is None:
            try:
                with self.sessions() as session:
                    lease.release(session, self.holder)
            except DATABASE_UNAVAILABLE as err:
                logger.warning("could not release the scheduler lease (it expires by itself "
                               "in %.0f s): %s", self.settings.lease_ttl_s, err)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def health(self) -> str:
        """running | standby (another server schedules) | stalled (no complete tick for a
        while: the database?) | stopped. Under `csx serve --workers`, a process standing by
        for another of the same server answers as that one would: the server schedules (a
        sibling that stalls loses the lease to this one)."""
        if not self.running:
            return "stopped"
        if self.standby is not None:
            return "running" if lease.is_sibling(self._standby_holder) else "standby"
        stale_after = max(10.0, 50 * self.settings.scheduler_interval_s)
        if time.monotonic() - self.last_tick_ok > stale_after:
            return "stalled"
        return "running"

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
        self._take_over("service restarted")

    def _take_over(self, why: str) -> None:
        """This server now schedules the database and no job of it runs anywhere: clear what
        killed checkpoint writes left, then adopt every job that holds systems."""
        for path in remove_unfinished_writes(self.settings.runs_dir):
            logger.info("removed %s, left by an interrupted checkpoint write", path)
        self._adopt_orphans(why)

    def _adopt_orphans(self, why: str) -> None:
        """Jobs that hold systems but have no execution in this process: put back in the
        queue if nothing ran yet, cancelled if that was asked, else resumed from the last
        checkpoint."""
        with self._executions_lock:
            tracked = set(self._executions)
        resume = []
        # A transaction that starts after the snapshot: a job whose thread ended before it
        # had recorded its outcome first, so it reads terminal here.
        with self.sessions() as session:
            for job in crud.jobs_in(session, statuses=HOLDING):
                if job.id in tracked:
                    continue
                status = JobStatus(job.status)
                if status is S.VALIDATING:
                    self._move(session, job, S.QUEUED, f"{why} during validation")
                elif status is S.CANCELLING:
                    self._move(session, job, S.CANCELLED, f"cancelled ({why})")
                elif status in RESUMABLE:
                    if status is not S.RECOVERING:
                        self._move(session, job, S.RECOVERING,
                                   f"{why}; resuming from the last checkpoint")
                    resume.append(job)
            session.commit()
        # Only after the commit: an execution thread must read RECOVERING, not the old state.
        for job in resume:
            execution = self._spawn(job, resume=True)
            joblogs.append(execution.folder, f"resuming ({why})")

    # ---- one pass --------------------------------------------------------------------------
    def tick(self) -> None:
        if not self._hold_lease():
            self.last_tick_ok = time.monotonic()
            return
        self._retry_outcomes()
        with self.sessions() as session:
            # One read of the jobs holding systems serves the tick's steps (each step reads
            # their status again: an earlier one may have moved them).
            holding = crud.jobs_in(session, statuses=HOLDING)
            held_ids = {job.id for job in holding}
            self._forward_stops(session, holding)
            self._give_back_lost_systems(holding)
            if not self.settings.paused:
                self._start_queued(session, [job for job in holding if job.status in HOLDING])
            self._report_finished_studies(session)
        # Read the holding jobs again only if one had no execution here: an execution that
        # ended without recording its outcome (its row still holds systems) is then adopted.
        with self._executions_lock:
            untracked = held_ids - set(self._executions)
        if untracked:
            self._adopt_orphans("its execution was lost")
        self.last_tick_ok = time.monotonic()

    def _take_lease(self) -> bool:
        """Acquire the lease, or stand by naming who holds it."""
        self._lease_checked = time.monotonic()
        try:
            with self.sessions() as session:
                lease.acquire(session, self.holder, self.settings.lease_ttl_s)
        except lease.LeaseHeld as held:
            # Once per holder: the message's expiry moves with every renewal.
            if self._standby_holder != held.holder and not lease.is_sibling(held.holder):
                logger.warning("standing by: %s. This server answers the API; it takes over "
                               "if that lease expires.", held)
            self.standby, self._standby_holder = str(held), held.holder
            return False
        self.standby = None
        return True

    def _hold_lease(self) -> bool:
        """Renew the lease a third of the way into it, or (standing by) try to take it over;
        True while this server schedules."""
        if time.monotonic() - self._lease_checked < self.settings.lease_ttl_s / 3:
            return self.standby is None
        if self.standby is not None:
            if not self._take_lease():
                return False
            self._take_over("took over from a server whose lease expired")
            return True
        with self.sessions() as session:
            renewed = lease.renew(session, self.holder, self.settings.lease_ttl_s)
        self._lease_checked = time.monotonic()
        if not renewed:
            # This server stalled past its lease and another one took over its jobs: stop
            # running them here, record nothing, and stand by.
            self.standby, self._standby_holder = \
                "another server took over this database's scheduler lease", ""
            logger.error("%s; stopping this server's worker groups", self.standby)
            with self._executions_lock:
                executions = list(self._executions.values())
            for execution in executions:
                execution.stop(SHUTDOWN)
        return renewed

    def _retry_outcomes(self) -> None:
        with self._executions_lock:
            pending = [e for e in self._executions.values()
                       if e.outcome is not None and (e.thread is None or not e.thread.is_alive())]
        for execution in pending:
            self._conclude(execution, retry_s=0.0)  # never hold the tick up

    def _forward_stops(self, session: Session, holding: list[Job]) -> None:
        now = datetime.now(UTC)
        for job in holding:
            if job.status not in (S.CANCELLING, S.RUNNING, S.RECOVERING):
                continue
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

    def _give_back_lost_systems(self, holding: list[Job]) -> None:
        """A node left the cluster: its jobs hold more systems than there are. Those whose
        workers wait for Ray to place them again (RECOVERING) would wait for a node that may
        never return, up to their timeout, holding systems another job could use: they go back
        to the queue (the newest first, until what is held fits), to resume from their last
        checkpoint once there is room."""
        systems = self.settings.cluster().systems
        holding = [job for job in holding if job.status in HOLDING]
        excess = sum(len(job.systems) for job in holding) - systems
        waiting = sorted((job for job in holding if job.status == S.RECOVERING),
                         key=lambda job: -job.id)
        for job in waiting:
            if excess <= 0:
                return
            execution = self._executions.get(job.id)
            if execution is not None and execution.stop_reason is None:
                joblogs.append(execution.folder, f"the cluster has {systems} systems, its jobs "
                               f"hold {excess + systems}: back to the queue")
                execution.stop(REQUEUE)
            excess -= len(job.systems)

    def _start_queued(self, session: Session, holding: list[Job]) -> None:
        cluster = self.settings.cluster()
        free = sorted(set(range(cluster.systems)) - {s for job in holding for s in job.systems})
        # The CPUs and GPUs the holding jobs' workers take: a job whose systems are free but
        # whose CPUs are not would wait on Ray while it reads RUNNING, and Ray would let a later
        # job overtake it (a 1-system job trains on every core by default: docs/clusters.md).
        used = [0.0, 0.0]
        for held in holding:
            used = [u + n for u, n in zip(used, footprint(cluster, held))]
        capacity = (cluster.systems * cluster.cpus_per_system, cluster.gpus)
        # Strict priority + FIFO: the head waits for its systems, CPUs and GPUs; nobody
        # overtakes it. Only the head is read, so a tick costs one indexed row however long
        # the queue is. A job larger than the whole cluster (which shrank since it was
        # admitted: a node left) is passed over until the cluster grows again.
        while ((job := crud.queue_head(session, max_systems=cluster.systems)) is not None
               and job.num_csx <= len(free)):
            need = footprint(cluster, job)
            if holding and any(u + n > c + 1e-9 for u, n, c in zip(used, need, capacity)):
                break
            systems = free[:job.num_csx]
            job.systems = systems
            self._move(session, job, S.VALIDATING, f"systems {systems} reserved")
            try:
                session.commit()
            except StaleDataError:  # cancelled (or moved) by the API meanwhile: next head
                session.rollback()
                continue
            used = [u + n for u, n in zip(used, need)]
            holding.append(job)
            free = free[job.num_csx:]
            self._spawn(job, resume=False)

    def _report_finished_studies(self, session: Session) -> None:
        """Queue the report of every study whose jobs all ended for its parent run (MLflow's
        background queue, service/run_tags.py), one write per study at a time."""
        for study in crud.studies_to_report(session):
            with self._executions_lock:
                if study.id in self._reporting:
                    continue
                self._reporting.add(study.id)
            run_tags.submit_write(self.settings.mlflow_tracking_uri,
                                  f"logging study {study.id}'s report to its parent run",
                                  partial(self._log_report, study.id))

    def _log_due_reports(self, timeout_s: float) -> None:
        """On stopping: the reports of studies that just ended go to MLflow first (`make run`
        stops its stack as soon as its study ends), for `timeout_s` at most."""
        try:
            with self.sessions() as session:
                self._report_finished_studies(session)
        except DATABASE_UNAVAILABLE as err:
            logger.warning("study reports not logged before stopping: %s", err)
            return
        if (away := mlflow_unreachable(self.settings.mlflow_tracking_uri)) is not None:
            # Waiting would only delay the stop (past docker's 10 s grace): the next start
            # logs them (their studies still have no report).
            logger.warning("study reports and run tags not logged before stopping: the MLflow "
                           "server does not answer (%s)", away)
            return
        run_tags.flush(self.settings.mlflow_tracking_uri, timeout_s)

    def _log_report(self, study_id: int) -> None:
        try:
            log_to_parent_run(self.settings, self.sessions, study_id)
        except Exception as err:  # MLflow or the database away: a later tick queues it again
            logger.warning("study %d's report not logged to its parent run yet: %s", study_id,
                           one_line(str(err), self.settings.runs_dir))
        finally:
            with self._executions_lock:
                self._reporting.discard(study_id)

    # ---- execution threads -----------------------------------------------------------------
    def _spawn(self, job: Job, *, resume: bool) -> Execution:
        execution = Execution(job.id, joblogs.job_dir(self.settings.runs_dir, job.id,
                                                      job.run_key))
        execution.thread = threading.Thread(target=self._execute, args=(execution, resume),
                                            name=f"csx-job-{job.id}", daemon=True)
        with self._executions_lock:
            self._executions[job.id] = execution
        execution.thread.start()
        return execution

    def _execute(self, execution: Execution, resume: bool) -> None:
        job_id = execution.job_id
        try:
            plan, launch_args = self._prepare(execution, resume)
            if execution.stop_reason is None:
                handle = self.launcher(plan, **launch_args)
                execution.attach(handle)
                self._started(job_id, handle)
                execution.outcome = (S.SUCCEEDED, "finished", handle.wait())
            else:
                execution.outcome = (S.FAILED, "stopped before launch", None)
        except Exception as err:
            # The job boundary: whatever went wrong becomes the job's FAILED reason (one line,
            # for users) and, with its traceback, the job's log.
            joblogs.append(execution.folder, traceback.format_exc())
            execution.outcome = (S.FAILED, user_reason(err, self.settings.runs_dir, job_id),
                                 None)
            if execution.stop_reason is None and self._cluster_lost():
                # Not the job's failure: its Ray head died. This process exits with it (a Ray
                # driver does), and the next start resumes the job (csx serve restarts it).
                execution.stop_reason = SHUTDOWN
        if execution.stop_reason == SHUTDOWN:
            joblogs.append(execution.folder, "service stopping or its Ray cluster lost: the job "
                                             "resumes from its last checkpoint at the next start")
            self._forget(execution)
            return
        self._conclude(execution)

    def _cluster_lost(self) -> bool:
        lost = getattr(self.launcher, "cluster_lost", None)
        return lost is not None and lost(wait_s=CLUSTER_LOSS_GRACE_S)

    def _conclude(self, execution: Execution, retry_s: float = DATABASE_RETRY_S) -> None:
        """Record the execution's outcome and forget it; if the database will not take it,
        keep it for a later tick to try again (the job keeps its systems until then)."""
        try:
            self._finish(execution, retry_s)
        except Exception:
            logger.exception("could not record the end of job %d; retrying next tick",
                             execution.job_id)
            return
        self._forget(execution)

    def _forget(self, execution: Execution) -> None:
        with self._executions_lock:
            if self._executions.get(execution.job_id) is execution:
                del self._executions[execution.job_id]
        self.wake()

    def _prepare(self, execution: Execution, resume: bool) -> tuple[Any, dict[str, Any]]:
        """The job's plan, made here once from its row and carried to its worker group;
        VALIDATING → PROVISIONING after the memory rule and the plan's report (with torch),
        or a resumed job planned again as it was admitted."""
        from csx_config import JobSpec
        from training.plan import plan_job

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
                # The experiment's name for the record; the run goes into the service's own
                # experiment of that name (launch_args' experiment_id, service/experiments.py).
                plan = plan_job(spec, job.num_csx, max_failures=job.max_failures,
                                experiment=experiment_name(self.settings.mlflow_access, owner_name(job),
                                                           job.experiment))
                if not resume:
                    from training.report import plan_report

                    job.plan = json.loads(json.dumps(plan_report(plan), default=str))
            except (ValueError, TypeError) as err:
                raise ValueError(f"invalid job: {err}") from err
            if not resume:
                ignored = job.plan.get("not_applied") or []
                note = f"; not applied here (hardware-only keys): {', '.join(ignored)}" if ignored else ""
                self._move(session, job, S.PROVISIONING, f"plan validated{note}")
            model_dir = execution.folder / "model"
            from service.studies import run_identity

            run_name, run_tags = run_identity(job)  # MLflow run name and csx.* tags
            launch_args = {
                "mode": job.mode, "model_dir": str(model_dir),
                "mlflow_run_id": job.mlflow_run_id,
                "progress": lambda event: self._on_progress(execution, event),
                "run_name": run_name, "tags": run_tags,
            }
            study_id, owner = job.study_id, (job.owner_id, owner_name(job), job.experiment)
            session.commit()
        # Outside the transaction: MLflow may take minutes to answer. While its server does
        # not answer, the job waits for it here (its status message says so) until it does or
        # the job is stopped; a call that fails because the server left meanwhile waits again.
        while self._mlflow_answers(execution):
            try:
                launch_args.update(self._mlflow_ids(job_id, owner, study_id,
                                                    launch_args["mlflow_run_id"]))
                break
            except Exception:
                if mlflow_unreachable(self.settings.mlflow_tracking_uri) is None:
                    raise
                joblogs.append(execution.folder, traceback.format_exc())
        return plan, launch_args

    def _mlflow_answers(self, execution: Execution) -> bool:
        """Whether the MLflow server answers, waiting for it while it does not: False when the
        job was stopped (cancel, shutdown) meanwhile."""
        shown: str | None = None
        while (away := mlflow_unreachable(self.settings.mlflow_tracking_uri)) is not None:
            if execution.stop_reason is not None:
                return False
            if shown != (message := f"waiting for the MLflow server: {away}"):
                shown = message
                self._say_mlflow_waits(execution, message)
                joblogs.append(execution.folder, message)
            if execution.stopped.wait(MLFLOW_POLL_S):
                return False
        if shown is not None:
            self._say_mlflow_waits(execution, None)
            joblogs.append(execution.folder, "the MLflow server answers again")
        return execution.stop_reason is None

    def _say_mlflow_waits(self, execution: Execution, message: str | None,
                          retry_s: float = DATABASE_RETRY_S) -> None:
        """Make `message` (why the job waits for its MLflow server) the job's status message,
        or with None put back the message the first one replaced."""

        def apply(session: Session, job: Job) -> None:
            shown, replaced = execution.mlflow_wait or (None, job.status_message)
            if message is None:
                if shown is not None and job.status_message == shown:
                    job.status_message = replaced
                execution.mlflow_wait = None
            elif job.status in (S.PROVISIONING, S.RUNNING, S.RECOVERING):  # not a cancel's
                job.status_message = message
                execution.mlflow_wait = (message, replaced)

        self._apply(execution.job_id, apply, retry_s=retry_s)

    def _mlflow_ids(self, job_id: int, owner: tuple[int, str, str], study_id: int | None,
                    run_id: str | None) -> dict[str, str | None]:
        """The job's experiment, its run (when a stopped server opened one) and its study's
        parent run: what its workers log to."""
        experiment_id = self._experiment_of(job_id, *owner)
        if run_id is None:
            # A run opened for the job by a server stopped before it recorded the run.
            run_id = find_run(self.settings, experiment_id, {"csx.job_id": str(job_id)})
        return {"tracking_uri": self.settings.mlflow_tracking_uri,
                "experiment_id": experiment_id, "mlflow_run_id": run_id,
                "parent_run_id": None if study_id is None else self._parent_run(study_id)}

    def _experiment_of(self, job_id: int, owner_id: int, owner_name: str,
                       experiment: str) -> str:
        """The job's MLflow experiment, the service's own (service/experiments.py), recorded
        on the job for its mlflow_url."""
        experiment_id = owned_experiment_id(self.sessions, self.settings, owner_id=owner_id,
                                            owner_name=owner_name, experiment=experiment)

        def record(session: Session, job: Job) -> None:
            job.mlflow_experiment_id = experiment_id

        self._apply(job_id, record)
        return experiment_id

    def _parent_run(self, study_id: int) -> str:
        """The study's parent MLflow run, opened by its first job to start (not by the request
        that submitted the study: that must not wait on MLflow), under a lock so the study's
        other jobs find it; no database transaction stays open while MLflow answers."""
        from service.studies import open_parent_run

        with self._parent_runs_lock:
            with self.sessions() as session:
                study = session.get(Study, study_id)
                assert study is not None  # a job's study is never deleted
                if study.mlflow_run_id is not None:
                    return study.mlflow_run_id
                session.expunge(study)  # its loaded fields (owner included) stay readable
            experiment_id = owned_experiment_id(
                self.sessions, self.settings, owner_id=study.owner_id,
                owner_name=owner_name(study), experiment=study.experiment)
            run_id = open_parent_run(self.settings, study, experiment_id)
            with self.sessions() as session:
                session.execute(update(Study).where(Study.id == study_id).values(
                    mlflow_experiment_id=experiment_id, mlflow_run_id=run_id))
                session.commit()
            return run_id

    def _started(self, job_id: int, handle: Handle) -> None:
        def apply(session: Session, job: Job) -> None:
            if handle.run_id and job.mlflow_run_id != handle.run_id:
                job.mlflow_run_id = handle.run_id
            if job.status in (S.PROVISIONING, S.RECOVERING):
                self._move(session, job, S.RUNNING, f"worker group of {job.num_csx} started")

        try:
            self._apply(job_id, apply)
        except Exception:
            # The group runs whatever the row says; the outcome's write moves it on.
            logger.exception("could not record that job %d started", job_id)

    def _on_progress(self, execution: Execution, event: dict[str, Any]) -> None:
        event = json.loads(json.dumps(event, default=str))
        joblogs.append(execution.folder, json.dumps(event))

        if event.get("event") == "checkpoint_skipped":  # training.loop.SKIPPED_CHECKPOINT
            return  # a warning for the job's log (written above), not progress
        if event.get("event") in (MLFLOW_AWAY, MLFLOW_BACK):  # from the run's tracker
            message = None if event["event"] == MLFLOW_BACK else (
                f"the MLflow server does not answer ({event.get('reason')}): the run's metrics "
                "and masks wait in the job's folder until it does")
            try:
                self._say_mlflow_waits(execution, message, retry_s=0.0)
            except Exception:  # the job's log says it (above); training goes on
                logger.warning("could not show job %d's MLflow wait", execution.job_id,
                               exc_info=True)
            return

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

        try:
            self._apply(execution.job_id, apply, retry_s=0.0)
        except Exception:
            # Progress is a snapshot (the next event replaces it) and it is in the job's log
            # already: never hold the training up waiting for the database.
            logger.warning("could not record progress of job %d", execution.job_id,
                           exc_info=True)

    def _finish(self, execution: Execution, retry_s: float) -> None:
        assert execution.outcome is not None
        outcome, message, result = execution.outcome
        if execution.stop_reason == "timeout":
            outcome, message = S.FAILED, "TIMEOUT: the job ran longer than its timeout_s"
        elif execution.stop_reason == "cancelled":
            outcome, message = S.CANCELLED, "cancelled"
        elif execution.stop_reason == REQUEUE:
            outcome, message = S.QUEUED, ("back in the queue: a node of the cluster left with "
                                          "its systems; resumes from its last checkpoint")

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
            if target is S.QUEUED and job.status != S.RECOVERING:
                self._move(session, job, S.RECOVERING, "worker group stopped")
            self._move(session, job, target, message)

        self._apply(execution.job_id, apply, retry_s=retry_s)
        joblogs.append(execution.folder, f"{outcome.value}: {message}")

    # ---- helpers ---------------------------------------------------------------------------
    def _apply(self, job_id: int, change: Callable[[Session, Job], None], tries: int = 5,
               retry_s: float = DATABASE_RETRY_S) -> None:
        """Run `change` on a fresh copy of the job and commit; redo it if the API moved the job
        in between (optimistic locking), so a decision is never based on a stale state, and
        while the database is unavailable, for up to `retry_s`."""
        deadline, pause = time.monotonic() + retry_s, 0.1
        stale = 0
        while True:
            try:
                with self.sessions() as session:
                    change(session, self._load(session, job_id))
                    session.commit()
                    return
            except StaleDataError:
                stale += 1
                if stale == tries:
                    raise
            except DATABASE_UNAVAILABLE as err:
                if time.monotonic() + pause > deadline:
                    raise
                logger.warning("database unavailable writing job %d (%s); retrying in %.1f s",
                               job_id, one_line(str(err), self.settings.runs_dir), pause)
                time.sleep(pause)
                pause = min(2 * pause, 5.0)

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


def footprint(cluster: ClusterSummary, job: Job) -> tuple[float, float]:
    """The CPUs and GPUs `job` takes from `cluster` while it holds its systems."""
    runconfig = (job.params or {}).get("runconfig") or {}
    return job_footprint(cluster, job.num_csx, cpus_per_csx=runconfig.get("cpus_per_csx"),
                         gpus_per_csx=runconfig.get("gpus_per_csx"))


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

