"""Data-parallel training over simulated CS-2 systems: one Ray actor per system, gloo (CPU) or
NCCL (GPU) between; every job, `num_csx` 1 included, from `csx run` or the service, runs here.

The driver (`start_job` / `run_job`) takes the job's plan (training/plan.py: made where the
job was admitted, `csx run` or the service's scheduler), creates the MLflow run, reserves a
placement group of `num_csx` bundles (each system's CPUs, GPUs and one `csx`:
workers/hardware.py; PACK or SPREAD as `runconfig.placement_strategy` says), starts one actor per bundle, lets rank 0 pick a
rendezvous port, forms a process group among them and has every actor call the same loop,
`training.loop.train`, with an `all_reduce` that averages gradients over the group (flattened
into one buffer per dtype: one collective per step, not one per tensor). Only rank 0 gets a
`Tracker` and reports progress.

Why actors and not Ray Train's TorchTrainer, which sizes workers the same way (ScalingConfig,
placement PACK/SPREAD): on the shared 2-core development machine (bench/hardware.py, 2 workers
of 1 CPU and one csx each, a trivial loop, load average 5-10) TorchTrainer reached the loop's
first line 27-34 s after `fit()` against 6-18 s for this group, and a `ray.train.report` took
0.18-0.20 s against 0.04-0.07 s for a progress event through our relay.

If an actor dies, the whole group is killed and a fresh one started, up to the plan's
`max_failures` times; `train()` resumes from the newest checkpoint in `model_dir`. Every rank returns the
hash of its masks after each mask update, and the driver refuses a run whose replicas
disagree, naming the first diverging update step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.hardware import (
    CSX_RESOURCE,
    SystemHardware,
    machine_resources,
    machine_systems,
    nodes_from_ray,
    per_system_hardware,
)
from workers.progress import ProgressRelay
from tracking.tracker import end_run, open_run, resolve_tracking_uri
from workers.replica import CsxWorker
from training.loop import MaskDivergence
from training.plan import MODES, JobPlan

log = logging.getLogger(__name__)

# After one rank fails, how long the others get to fail too (peers of a killed process see
# gloo connection errors within milliseconds) before the failure is classified.
FAILURE_GRACE_S = 10.0
# How often a job waiting for its placement group checks for a cancel, and after how long it
# says that it waits (the cluster's systems are busy, or a node is gone).
PLACEMENT_POLL_S = 0.5
PLACEMENT_NOTICE_S = 10.0
MASK_HASHES_KEY = "mask_hashes"
ProgressCallback = Callable[[dict[str, Any]], None]


class JobCancelled(RuntimeError):
    """The job was cancelled through `JobHandle.cancel`; its actors are gone."""


class JobFailed(RuntimeError):
    """Workers kept dying: more than `max_failures` restarts were needed."""


def connect_ray(systems: int, address: str | None = None) -> None:
    """Reuse an initialised runtime, else join `address` or RAY_ADDRESS, else start a local one
    declaring `systems` CS-2 systems or the machine's (workers/hardware.py), whichever is more.

    A local runtime started here lives only as long as the calling *thread* (Ray ties
    gcs_server and raylet to it with PR_SET_PDEATHSIG): long-lived callers that launch from
    short-lived threads (the service) must pass the address of a head they run themselves.

    The local runtime has the dashboard UI off (heavy and unneeded) and token auth disabled
    (on by default in Ray 2.60, it breaks local use). Ray 2.60 rewrites a node address of
    127.0.0.1 to the machine's routable one, so asking for loopback would have no effect.
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(address="local", include_dashboard=False,
                 num_cpus=max(systems, os.cpu_count() or 1),
                 resources=machine_resources(max(systems, machine_systems())), log_to_driver=False)


# Where MLflow's client reads a tracking server's credentials.
MLFLOW_CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


def _worker_runtime_env() -> dict[str, Any]:
    """Environment of the job's workers, set before their torch loads.

    OpenMP threads wait passively (unless OMP_WAIT_POLICY says otherwise): spinning ones make a
    worker of 2 threads 3-4x slower than one thread as soon as other processes share the
    cores (bench/hardware.py's matmul ceiling, measured on the shared 2-core machine), while
    passive waiting keeps it at least as fast as one thread. And `csx run --python_paths`
    folders: a runtime started before the flag was read (a reused one) did not inherit them.
    """
    from sparsity.plugins import ENV_VAR

    env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    # With MLflow's authentication on, the account the service logs with (service/mlflow_auth.py):
    # handed to the job's workers only, the Ray nodes' own environment never holds it.
    env |= {name: os.environ[name] for name in MLFLOW_CREDENTIALS if os.environ.get(name)}
    if os.environ.get(ENV_VAR):
        env[ENV_VAR] = os.environ[ENV_VAR]
    return {"env_vars": env}


def resolve_hardware(plan: JobPlan) -> SystemHardware:
    """Each system's CPUs and GPUs for this job on the connected cluster (the plan's
    cpus_per_csx / gpus_per_csx, else the cluster's share); ValueError when it can never fit."""
    asked = plan.hardware
    return per_system_hardware(nodes_from_ray(ray.nodes()), plan.num_csx,
                               cpus_per_csx=asked.cpus_per_csx, gpus_per_csx=asked.gpus_per_csx,
                               placement=asked.placement)


def first_mask_divergence(hashes_per_rank: list[list[Any]]) -> str | None:
    """None when every rank saw the same mask hashes, else a message naming the first diverging
    update (the list entries are (step, hash) pairs or bare hashes)."""
    reference = hashes_per_rank[0]
    for rank, hashes in enumerate(hashes_per_rank[1:], start=1):
        for index, (ours, theirs) in enumerate(zip(reference, hashes)):
            if ours != theirs:
                step = ours[0] if isinstance(ours, (tuple, list)) else f"update #{index + 1}"
                return (f"mask divergence at step {step}: rank 0 has {ours!r}, "
                        f"rank {rank} has {theirs!r}")
        if len(hashes) != len(reference):
            return (f"mask divergence: rank 0 recorded {len(reference)} mask updates, "
                    f"rank {rank} recorded {len(hashes)}")
    return None


class JobHandle:
    """A running job: `wait()` for its summary, `cancel()` to stop it (kills every actor)."""

    def __init__(self, plan: JobPlan, *, mode: str, model_dir: str, run_id: str | None,
                 tracking_uri: str | None, progress: ProgressCallback | None,
                 train_fn: Callable[..., dict] | None, hardware: SystemHardware) -> None:
        self.plan = plan
        self.num_csx = plan.num_csx
        self.hardware = hardware
        self.mode = mode
        self.model_dir = model_dir
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.max_failures = plan.max_failures
        self.attempts = 0
        self._progress = progress
        self._train_fn = train_fn
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._actors: list[Any] = []  # the current attempt's workers and progress relay
        self._placement: Any = None  # the current attempt's placement group
        self._pids: list[int] = []
        self.workers: list[dict[str, Any]] = []  # where each rank ran (replica.locate)

    def worker_pids(self) -> list[int]:
        """Process ids of the current attempt's actors, by rank."""
        with self._lock:
            return list(self._pids)

    def cancel(self) -> None:
        """Stop the job: every actor of the current attempt is killed; `wait()` then raises
        JobCancelled and the MLflow run ends KILLED."""
        self._cancelled.set()
        self._kill_group()

    def wait(self) -> dict[str, Any]:
        """Run attempts until one succeeds; return rank 0's summary plus run bookkeeping."""
        failures = 0
        try:
            while True:
                self._check_cancelled()
                try:
                    results = self._run_attempt()
                    break
                except RayActorError as err:
                    self._kill_group()
                    self._check_cancelled()
                    failures += 1
                    if failures > self.max_failures:
                        raise JobFailed(f"a worker died {failures} times, more than "
                                        f"max_failures={self.max_failures}: {err}") from err
                    log.warning("worker lost (%s); restart %d of %d from the latest checkpoint",
                                err, failures, self.max_failures)
                    self._emit({"event": "recovering", "attempt": self.attempts + 1,
                                "failures": failures, "error": str(err)})
        except BaseException as err:
            self._kill_group()
            if self.run_id is not None:
                status = "KILLED" if isinstance(err, JobCancelled) else "FAILED"
                end_run(self.run_id, status, tracking_uri=self.tracking_uri)
            raise
        return self._summarise(results, restarts=failures)

    def _run_attempt(self) -> list[dict[str, Any]]:
        """One group of fresh actors in a fresh placement group (and a fresh relay: a dead
        attempt's half-delivered event must not block the next one) from start to finish."""
        self.attempts += 1
        hardware = self.hardware
        group = placement_group([hardware.bundle()] * self.num_csx, strategy=hardware.placement)
        with self._lock:
            self._placement = group
        self._await_placement(group)
        actors = [CsxWorker.options(
            num_cpus=hardware.cpus, num_gpus=hardware.gpus, resources={CSX_RESOURCE: 1},
            runtime_env=_worker_runtime_env(),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank)).remote(
            rank, self.num_csx, hardware.cpus, hardware.device)
            for rank in range(self.num_csx)]
        relay = ProgressRelay.remote() if self._progress is not None else None
        with self._lock:
            self._actors = actors + ([relay] if relay is not None else [])
        located = ray.get([actor.locate.remote() for actor in actors])
        with self._lock:
            self._pids = [where["pid"] for where in located]
        self.workers = [{k: v for k, v in where.items() if k != "pid"} for where in located]
        self._check_cancelled()
        if self.num_csx > 1:
            # One node (the usual local case): rendezvous on loopback only. Ray itself cannot
            # be held to 127.0.0.1 (2.60 rewrites it to the routable address).
            nodes = {where["node"] for where in located}
            host = "127.0.0.1" if len(nodes) == 1 else located[0]["node"]
            port = ray.get(actors[0].free_port.remote(host))
            ray.get([actor.join_group.remote(host, port) for actor in actors])
        tracker_args = None
        if self.run_id is not None:
            tracker_args = {"experiment": self.plan.experiment,
                            "run_id": self.run_id, "tracking_uri": self.tracking_uri}
        refs = [actor.train.remote(self.plan, model_dir=self.model_dir, mode=self.mode,
                                   tracker_args=tracker_args if rank == 0 else None,
                                   relay=relay if rank == 0 else None,
                                   train_fn=self._train_fn)
                for rank, actor in enumerate(actors)]
        results = self._collect(refs, relay)
        self._kill_group()
        return results

    def _await_placement(self, group: Any) -> None:
        """Wait until Ray reserved every bundle, saying so once when that takes a while (the
        cluster's systems are busy); a cancel ends the wait."""
        ready = group.ready()
        started = time.monotonic()
        noticed = False
        while not ray.wait([ready], timeout=PLACEMENT_POLL_S)[0]:
            self._check_cancelled()
            if not noticed and time.monotonic() - started > PLACEMENT_NOTICE_S:
                noticed = True
                log.warning("waiting for Ray to place %d systems of %s (other jobs hold them, "
                            "or a node is gone)", self.num_csx, self.hardware.bundle())
        self._check_cancelled()

    def _collect(self, refs: list[Any], relay: Any) -> list[dict[str, Any]]:
        """Wait for every rank, delivering progress events as they come."""
        take = relay.take.remote() if relay is not None else None
        pending = list(refs)
        while pending:
            watched = pending + ([take] if take is not None else [])
            ready, _ = ray.wait(watched, num_returns=1)
            if take is not None and take in ready:
                self._emit(ray.get(take))
                take = relay.take.remote()  # releases rank 0, which waited for us
                continue
            finished = [ref for ref in pending if ref in ready]
            try:
                ray.get(finished)
            except (RayActorError, RayTaskError) as err:
                raise self._classify_failure(err, [r for r in pending if r not in finished])
            pending = [ref for ref in pending if ref not in finished]
        return ray.get(refs)

    def _classify_failure(self, first: Exception, others: list[Any]) -> Exception:
        """A dead actor anywhere makes this a lost worker (restartable); otherwise the first
        rank's exception is a real error in the job and ends it."""
        if isinstance(first, RayActorError):
            return first
        ready, _ = ray.wait(others, num_returns=len(others), timeout=FAILURE_GRACE_S)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as lost:
                return lost
            except RayTaskError:
                continue  # a peer's gloo error: a symptom, not the cause
        if self._cancelled.is_set():
            return JobCancelled("job cancelled")
        return first.as_instanceof_cause() if isinstance(first, RayTaskError) else first

    def _summarise(self, results: list[dict[str, Any]], restarts: int) -> dict[str, Any]:
        divergence = first_mask_divergence([r.get(MASK_HASHES_KEY, []) for r in results])
        if divergence is not None:
            raise MaskDivergence(divergence)
        summary = dict(results[0])  # rank 0's, including its all-reduce time and call count
        summary.update({"run_id": self.run_id, "num_csx": self.num_csx,
                        "attempts": self.attempts, "restarts": restarts,
                        "cpus_per_csx": self.hardware.cpus, "gpus_per_csx": self.hardware.gpus,
                        "workers": self.workers})
        return summary

    def _emit(self, event: dict[str, Any]) -> None:
        if self._progress is not None:
            self._progress(event)

    def _check_cancelled(self) -> None:
        if self._cancelled.is_set():
            raise JobCancelled("job cancelled")

    def _kill_group(self) -> None:
        with self._lock:
            actors, self._actors, self._pids = self._actors, [], []
            group, self._placement = self._placement, None
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if group is not None:  # frees the bundles for the next attempt and other jobs
            remove_placement_group(group)


def start_job(plan: JobPlan, *, mode: str = "train", model_dir: str,
              mlflow_run_id: str | None = None, experiment_id: str | None = None,
              parent_run_id: str | None = None, progress: ProgressCallback | None = None,
              tracking: bool = True, tracking_uri: str | None = None,
              run_name: str | None = None, tags: Mapping[str, str] | None = None,
              train_fn: Callable[..., dict] | None = None) -> JobHandle:
    """Create (or reuse) the MLflow run, connect to Ray and start the first attempt's
    bookkeeping for `plan` (training.plan.plan_job); the returned handle runs the job in
    `wait()`.

    `train_fn` is the per-rank loop with `training.loop.train`'s signature (the default).
    `run_name` and `tags` name and tag a newly created run (see `open_run`), in experiment
    `experiment_id` when given, else in the one the plan names.
    """
    if not isinstance(plan, JobPlan):
        raise TypeError(f"plan must be a training.plan.JobPlan, got {type(plan).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    os.makedirs(model_dir, exist_ok=True)
    model_dir = os.path.abspath(model_dir)

    connect_ray(systems=plan.num_csx)
    hardware = resolve_hardware(plan)
    run_id = None
    if tracking:
        tracking_uri = resolve_tracking_uri(tracking_uri)
        run_id = mlflow_run_id or open_run(plan, tracking_uri=tracking_uri, parent_run_id=parent_run_id,
                                           run_name=run_name, tags=tags, experiment_id=experiment_id)
    return JobHandle(plan, mode=mode, model_dir=model_dir, run_id=run_id, tracking_uri=tracking_uri,
                     progress=progress, train_fn=train_fn, hardware=hardware)


def run_job(plan: JobPlan, *, mode: str = "train", model_dir: str,
            mlflow_run_id: str | None = None, experiment_id: str | None = None,
            parent_run_id: str | None = None, progress: ProgressCallback | None = None,
            tracking: bool = True, tracking_uri: str | None = None,
            run_name: str | None = None, tags: Mapping[str, str] | None = None,
            train_fn: Callable[..., dict] | None = None) -> dict[str, Any]:
    """Run a job to completion on its plan's `num_csx` simulated systems and return its summary."""
    started = time.perf_counter()
    handle = start_job(plan, mode=mode, model_dir=model_dir, mlflow_run_id=mlflow_run_id,
                       experiment_id=experiment_id, parent_run_id=parent_run_id, progress=progress,
                       tracking=tracking, tracking_uri=tracking_uri, train_fn=train_fn,
                       run_name=run_name, tags=tags)
    summary = handle.wait()
    summary["job_wall_s"] = time.perf_counter() - started
    return summary
