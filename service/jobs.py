"""From a submission to Job columns, and from a Job row to what the API shows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session

from service import crud
from service.checkpoints import resolve_checkpoint
from service.crud import Caller
from service.models import Job
from service.preflight import Problem, check_params
from service.schemas import JobDetail, JobPublic, RunOptions
from service.settings import Settings
from csx_config import JobSpec


class SubmissionError(ValueError):
    """Problems found in a submission, each (location, message); the API answers 422."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in problems))
        self.problems = problems


def resolve_num_csx(options: RunOptions, spec: JobSpec) -> int:
    return options.num_csx if options.num_csx is not None else spec.runconfig.num_csx


def check_submission(options: RunOptions, spec: JobSpec, settings: Settings, *,
                     session: Session, caller: Caller) -> str | None:
    """The torch-free checks that need the service's settings, the database and the caller;
    raises SubmissionError. Returns the checkpoint file the job starts from, if any."""
    params = spec.model_dump()
    problems = [(("params", *loc), msg) for loc, msg in
                check_params(params, allowed_data_roots=settings.allowed_data_roots)]
    checkpoint, refused = resolve_checkpoint(session, caller, settings.runs_dir,
                                             options.checkpoint, params)
    problems += refused
    num_csx = resolve_num_csx(options, spec)
    if num_csx > settings.cluster_size:
        where = ("num_csx",) if options.num_csx is not None else ("params", "runconfig", "num_csx")
        problems.append((where, f"num_csx {num_csx} exceeds the cluster's "
                                f"{settings.cluster_size} CS-2 systems"))
    if spec.train_input.batch_size % num_csx:
        problems.append((("params", "train_input", "batch_size"),
                         f"global batch_size {spec.train_input.batch_size} must divide evenly "
                         f"over num_csx={num_csx}"))
    if problems:
        raise SubmissionError(problems)
    return checkpoint


def job_fields(options: RunOptions, spec: JobSpec, *, name: str | None,
               checkpoint: str | None = None) -> dict[str, Any]:
    """Job columns for a checked submission; unset options fall back to the params' runconfig.
    `checkpoint` is check_submission's answer: the file the worker reads."""
    runconfig = spec.runconfig
    params = spec.model_dump(mode="json")
    if checkpoint is not None:
        params["runconfig"]["checkpoint_path"] = checkpoint
    return {
        "name": name or f"{runconfig.mlflow_experiment}-{spec.model.preset or 'custom'}",
        "experiment": options.experiment or runconfig.mlflow_experiment,
        "mode": options.mode,
        "num_csx": resolve_num_csx(options, spec),
        "priority": options.priority,
        "max_failures": (options.max_failures if options.max_failures is not None
                         else runconfig.max_failures),
        "timeout_s": options.timeout_s,
        "tags": dict(options.tags),
        "params": params,
    }


def mlflow_url(settings: Settings, experiment_id: str | None, run_id: str | None) -> str | None:
    if experiment_id is None or run_id is None:
        return None
    return f"{settings.mlflow_ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def job_public(session: Session, job: Mapping[str, Any], owner: str,
               settings: Settings) -> JobPublic:
    """The public view of a job from its column values: an ORM Job's (`to_public`) or the row
    a submission's INSERT returned, so a new job is shown without reading it back."""
    return JobPublic.model_validate({
        **{name: job[name] for name in _PUBLIC_COLUMNS},
        "owner": owner,
        "queue_position": crud.queue_position(session, job=job),
        "mlflow_url": mlflow_url(settings, job["mlflow_experiment_id"], job["mlflow_run_id"]),
    })


def to_public(session: Session, job: Job, settings: Settings) -> JobPublic:
    columns = {name: getattr(job, name) for name in _PUBLIC_COLUMNS}
    return job_public(session, columns, job.owner.name, settings)


def to_detail(session: Session, job: Job, settings: Settings) -> JobDetail:
    return JobDetail.model_validate({**dict(to_public(session, job, settings)),
                                     "params": job.params, "plan": job.plan})


# The Job columns a JobPublic is built from; owner, queue_position and mlflow_url are derived.
_PUBLIC_COLUMNS = (*(name for name in JobPublic.model_fields
                     if name not in ("owner", "queue_position", "mlflow_url")),
                   "mlflow_experiment_id")
