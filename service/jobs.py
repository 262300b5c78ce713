"""From a submission to Job columns, and from a Job row to what the API shows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from service import crud
from service.checkpoints import resolve_checkpoint, resolve_tokenizer_files
from service.crud import Caller
from service.models import Job, owner_name
from service.preflight import Problem, check_params
from service.schemas import MAX_NAME_CHARS, JobDetail, JobPublic, RunOptions
from service.settings import Settings
from csx_config import JobSpec, batch_split_problem
from training import memory
from workers.hardware import ClusterSummary


class SubmissionError(ValueError):
    """Problems found in a submission, each (location, message); the API answers 422."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in problems))
        self.problems = problems


def resolve_num_csx(options: RunOptions, spec: JobSpec) -> int:
    return options.num_csx if options.num_csx is not None else spec.runconfig.num_csx


@dataclass(frozen=True)
class ResolvedFiles:
    """The files a checked submission reads, as the absolute paths its worker opens."""

    checkpoint: str | None = None
    tokenizer: dict[str, str] = field(default_factory=dict)  # vocab_file / merges_file


def check_submission(options: RunOptions, spec: JobSpec, settings: Settings, *,
                     session: Session, caller: Caller) -> ResolvedFiles:
    """The torch-free checks that need the service's settings, the database and the caller;
    raises SubmissionError. Returns the files the job reads (checkpoint, tokenizer)."""
    params = spec.model_dump()
    problems = [(("params", *loc), msg) for loc, msg in
                check_params(params, allowed_data_roots=settings.allowed_data_roots)]
    checkpoint, refused = resolve_checkpoint(session, caller, settings.runs_dir,
                                             options.checkpoint, params)
    problems += refused
    tokenizer, refused = resolve_tokenizer_files(session, caller, settings.runs_dir,
                                                 settings.allowed_data_roots, params)
    problems += refused
    if options.experiment is None and len(spec.runconfig.mlflow_experiment) > MAX_NAME_CHARS:
        problems.append((("params", "runconfig", "mlflow_experiment"),
                         f"an experiment name has at most {MAX_NAME_CHARS} characters (the "
                         f"jobs' experiment column), got {len(spec.runconfig.mlflow_experiment)}"))
    num_csx = resolve_num_csx(options, spec)
    systems = settings.systems
    if num_csx > systems:
        where = ("num_csx",) if options.num_csx is not None else ("params", "runconfig", "num_csx")
        problems.append((where, f"num_csx {num_csx} exceeds the cluster's "
                                f"{systems} CS-2 systems"))
    if split := batch_split_problem(spec.train_input.batch_size, num_csx):
        problems.append((("params", "train_input", "batch_size"), split))
    if not problems:  # sized only once its data paths are known to be allowed
        problems = memory_problems(spec, num_csx, settings)
    if problems:
        raise SubmissionError(problems)
    return ResolvedFiles(checkpoint, tokenizer)


def memory_problems(spec: JobSpec, num_csx: int, settings: Settings) -> list[Problem]:
    """Admission: the plan's memory estimate (arithmetic, any size in microseconds) against
    what each of the job's workers has: its share of its node's memory, and its GPU's."""
    try:
        refusal = memory.too_big(spec, num_csx, settings.memory_per_csx_bytes)
    except ValueError as err:  # it cannot be sized: model.vocab_size below the tokenizer's
        return [(("params", "model"), str(err))]
    host = [(("params", "model"), refusal)] if refusal else []
    return host + gpu_problems(spec, num_csx, settings.cluster())


def gpu_problems(spec: JobSpec, num_csx: int, cluster: ClusterSummary) -> list[Problem]:
    """A job that trains on GPUs (gpus_per_csx > 0, or unset where the cluster has a GPU per
    system, as the runner then grants one) needs GPUs, and its per-system estimate must fit
    one GPU's memory as the nodes declare it (not checked where no node declares it)."""
    asked = spec.runconfig.gpus_per_csx
    gpus = asked if asked is not None else int(cluster.gpus_per_system >= 1)
    if not gpus:
        return []
    where = ("params", "runconfig", "gpus_per_csx")
    named = f"gpus_per_csx {gpus}" if asked is not None else f"gpus_per_csx (unset: {gpus} here)"
    if not cluster.gpus:
        return [(where, f"{named}: the cluster has no GPUs ({cluster.describe()}); set "
                        "gpus_per_csx: 0 to train on CPUs")]
    if not cluster.gpu_memory_bytes:  # no node declares it: nothing to compare with
        return []
    refusal = memory.too_big_for_gpu(spec, num_csx, cluster.gpu_memory_bytes)
    return [(where, f"{named}: {refusal}")] if refusal else []


def job_fields(options: RunOptions, spec: JobSpec, settings: Settings, *, name: str | None,
               files: ResolvedFiles = ResolvedFiles()) -> dict[str, Any]:
    """Job columns for a checked submission; unset options fall back to the params' runconfig
    (and timeout_s to the settings'). `files` is check_submission's answer: the paths the
    worker reads replace the user's."""
    runconfig = spec.runconfig
    params = spec.model_dump(mode="json")
    if files.checkpoint is not None:
        params["runconfig"]["checkpoint_path"] = files.checkpoint
    params["model"]["tokenizer"].update(files.tokenizer)
    return {
        "name": name or f"{runconfig.mlflow_experiment}-{spec.model.preset or 'custom'}",
        "experiment": options.experiment or runconfig.mlflow_experiment,
        "mode": options.mode,
        "num_csx": resolve_num_csx(options, spec),
        "priority": options.priority,
        "max_failures": (options.max_failures if options.max_failures is not None
                         else runconfig.max_failures),
        "timeout_s": options.timeout_s or settings.default_timeout_s,
        "tags": dict(options.tags),
        "params": params,
    }


def mlflow_url(settings: Settings, experiment_id: str | None, run_id: str | None) -> str | None:
    if experiment_id is None or run_id is None:
        return None
    return f"{settings.mlflow_ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def job_public(job: Mapping[str, Any], owner: str, settings: Settings,
               queue_position: int | None) -> JobPublic:
    """The public view of a job from its column values: an ORM Job's (`to_public`) or the row
    a submission's INSERT returned, so a new job is shown without reading it back."""
    return JobPublic.model_validate({
        **{name: job[name] for name in _PUBLIC_COLUMNS},
        "owner": owner,
        "queue_position": queue_position,
        "mlflow_url": mlflow_url(settings, job["mlflow_experiment_id"], job["mlflow_run_id"]),
    })


def to_public(session: Session, job: Job, settings: Settings) -> JobPublic:
    columns = _columns(job)
    return job_public(columns, owner_name(job), settings,
                      crud.queue_position(session, job=columns))


def to_public_list(session: Session, jobs: list[Job], settings: Settings) -> list[JobPublic]:
    """to_public of each job, their queue positions read at once."""
    columns = [_columns(job) for job in jobs]
    positions = crud.queue_positions(session, jobs=columns)
    return [job_public(c, owner_name(job), settings, positions.get(c["id"]))
            for job, c in zip(jobs, columns)]


def _columns(job: Job) -> dict[str, Any]:
    return {name: getattr(job, name) for name in _PUBLIC_COLUMNS}


def to_detail(session: Session, job: Job, settings: Settings) -> JobDetail:
    return JobDetail.model_validate({**dict(to_public(session, job, settings)),
                                     "params": job.params, "plan": job.plan})


# The Job columns a JobPublic is built from; owner, queue_position and mlflow_url are derived.
_PUBLIC_COLUMNS = (*(name for name in JobPublic.model_fields
                     if name not in ("owner", "queue_position", "mlflow_url")),
                   "mlflow_experiment_id")
