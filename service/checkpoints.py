"""Which files a REST job may read or write: checkpoints of jobs its owner can see, tokenizer
files under the allowed data roots or in such a job's folder, and a model_dir inside the job's
own folder.

A job starts from (or evaluates) a checkpoint named by job id, `checkpoint: {job: 12, step: 50}`
(newest step when `step` is left out), or by a path in `runconfig.checkpoint_path` that lies in
the folder of a job the caller can see. Everything else is refused with one message whatever
the reason (no such job, someone else's job, no such step, a path elsewhere): the answer tells
nothing about what exists outside what the caller may see.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service import joblogs
from service.crud import Caller
from service.models import Job
from service.preflight import Problem, is_within, resolve_path
from service.schemas import MAX_ID
from training.safe_files import RefusedFile, regular_file

CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)\.mdl$")  # training/checkpoint.py's names
# The temporary files training/checkpoint.py writes a checkpoint (and its digest) through.
UNFINISHED_WRITE = re.compile(r"^\.checkpoint_\d+\.mdl\.(?:sha256\.)?[^/]+\.tmp$")
JOB_FOLDER = re.compile(r"^job-(\d+)(?:-([0-9a-f]+))?$")  # joblogs.job_dir's names


def checkpoint_file(folder: Path, step: int | None) -> Path | None:
    """The checkpoint at `step` (the newest when None) in a job's folder, or None; RefusedFile
    when that is a link out of the folder (to someone else's checkpoint) or not a regular file."""
    model_dir = folder / "model"
    steps = {}
    if model_dir.is_dir():
        for path in model_dir.iterdir():
            match = CHECKPOINT_NAME.match(path.name)
            if match:
                steps[int(match.group(1))] = path
    if step is None:
        step = max(steps, default=None)
    if step not in steps:
        return None
    try:
        return regular_file(steps[step], inside=folder)
    except FileNotFoundError:  # a dangling link, or removed since listed
        return None


def remove_unfinished_writes(runs_dir: Path) -> list[Path]:
    """Delete the temporary files of checkpoint writes a kill interrupted, in every job's model
    folder; call it only while no job of this runs folder runs (the scheduler's start). Returns
    what it deleted."""
    removed = []
    for path in runs_dir.glob("job-*/model/.*.tmp"):
        if UNFINISHED_WRITE.match(path.name) and JOB_FOLDER.match(path.parent.parent.name):
            path.unlink(missing_ok=True)  # a link is removed, never followed
            removed.append(path)
    return removed


def visible_folder(session: Session, caller: Caller, runs_dir: Path, job_id: int) -> Path | None:
    """The folder of job `job_id` if the caller can see the job, else None."""
    if not 1 <= job_id <= MAX_ID:
        return None
    row = session.execute(select(Job.owner_id, Job.run_key).where(Job.id == job_id)).first()
    if row is None or not (caller.is_admin or row.owner_id == caller.id):
        return None
    return joblogs.job_dir(runs_dir, job_id, row.run_key)


def resolve_checkpoint(session: Session, caller: Caller, runs_dir: Path,
                       reference: Any, params: Mapping[str, Any]) -> tuple[str | None, list[Problem]]:
    """The checkpoint file a submission starts from (None: none), or the problems that refuse it.

    `reference` is the `checkpoint` option ({job, step}) or None; `params` the raw params."""
    runconfig = params.get("runconfig")
    runconfig = runconfig if isinstance(runconfig, Mapping) else {}
    raw_path = runconfig.get("checkpoint_path")
    problems = _model_dir_problems(runconfig.get("model_dir"))
    if reference is not None and raw_path is not None:
        problems.append((("checkpoint",), "give either `checkpoint` or "
                                          "params.runconfig.checkpoint_path, not both"))
        return None, problems
    if reference is not None:
        job_id, step = reference.job, reference.step
        folder = visible_folder(session, caller, runs_dir, job_id)
        try:
            found = checkpoint_file(folder, step) if folder is not None else None
        except RefusedFile as err:  # the caller may see this job: its file can be named
            problems.append((("checkpoint",), f"{Path(err.path).name} of job {job_id} {err.why}; "
                                              "refused"))
            return None, problems
        if found is None:
            at = f"step {step}" if step is not None else "any step"
            problems.append((("checkpoint",), f"no checkpoint at {at} of a job {job_id} you "
                                              "can see"))
        return (str(found) if found else None), problems
    if raw_path is None:
        return None, problems
    where = ("params", "runconfig", "checkpoint_path")
    refusal = (where, "must name a checkpoint in the folder of a job you can see, "
                      "<job folder>/model/checkpoint_<step>.mdl (or use "
                      "`checkpoint: {job: <id>, step: <step>}`)")
    resolved = resolve_path(raw_path, runs_dir) if isinstance(raw_path, str) else None
    if resolved is None or not in_visible_job(session, caller, runs_dir, resolved) \
            or not resolved.is_file():
        return None, [*problems, refusal]
    return str(resolved), problems


def in_visible_job(session: Session, caller: Caller, runs_dir: Path, path: Path) -> bool:
    """Whether the resolved `path` lies inside the folder of a job the caller can see: a
    folder whose run key is not its job's (left by another database) belongs to no job."""
    root = runs_dir.resolve()
    if not is_within(path, root) or path == root:
        return False
    name = path.relative_to(root).parts[0]
    folder = JOB_FOLDER.match(name)
    if folder is None:
        return False
    visible = visible_folder(session, caller, root, int(folder.group(1)))
    return visible is not None and visible.name == name


def readable_file(session: Session, caller: Caller, runs_dir: Path, data_roots: Sequence[Path],
                  raw: Any) -> str | None:
    """`raw` as the absolute path of a file the caller may read (under an allowed data root or
    in a job folder the caller can see), or None: missing, forbidden and malformed are one
    answer, so a refusal says nothing about what exists on the host."""
    resolved = resolve_path(raw) if isinstance(raw, str) else None
    if resolved is None:
        return None
    roots = [root for root in map(resolve_path, map(str, data_roots)) if root is not None]
    allowed = any(is_within(resolved, root) for root in roots) \
        or in_visible_job(session, caller, runs_dir, resolved)
    return str(resolved) if allowed and resolved.is_file() else None


TOKENIZER_FILES = ("vocab_file", "merges_file")


def resolve_tokenizer_files(session: Session, caller: Caller, runs_dir: Path,
                            data_roots: Sequence[Path], params: Mapping[str, Any]
                            ) -> tuple[dict[str, str], list[Problem]]:
    """model.tokenizer's files as absolute paths the worker opens, or the problems refusing
    them (one message for missing and forbidden, as for checkpoints)."""
    model = params.get("model")
    tokenizer = model.get("tokenizer") if isinstance(model, Mapping) else None
    if not isinstance(tokenizer, Mapping):
        return {}, []
    files, problems = {}, []
    for key in TOKENIZER_FILES:
        if tokenizer.get(key) is None:
            continue
        found = readable_file(session, caller, runs_dir, data_roots, tokenizer[key])
        if found is None:
            problems.append((("params", "model", "tokenizer", key),
                             "must name a file you may read: one under the allowed data roots "
                             "or in the folder of a job you can see"))
        else:
            files[key] = found
    return files, problems


def _model_dir_problems(model_dir: Any) -> list[Problem]:
    """The service keeps each job's model in its folder's model/; a relative model_dir (what
    ModelZoo params files carry) stays inside it, anything else is refused."""
    if model_dir is None:
        return []
    path = Path(model_dir) if isinstance(model_dir, str) and "\x00" not in model_dir else None
    if path is None or path.is_absolute() or ".." in path.parts or model_dir.startswith("~"):
        return [(("params", "runconfig", "model_dir"),
                 "must be a relative path inside the job's own folder (the service keeps each "
                 "job's model in its folder's model/); leave it out")]
    return []
