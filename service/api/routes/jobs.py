"""/jobs: submit (JSON or YAML, idempotent), validate, list, inspect, cancel, retry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from service import crud, joblogs
from service.api.body import (
    nest_params,
    read_mapping,
    request_body_openapi,
    unprocessable,
    validate,
)
from service.api.deps import CurrentUser, OwnedJob, SchedulerDep, SessionDep, SettingsDep
from service.crud import Caller
from service.jobs import (
    ResolvedFiles,
    SubmissionError,
    check_submission,
    job_fields,
    job_public,
    memory_problems,
    resolve_num_csx,
    to_detail,
    to_public,
    to_public_list,
)
from service.models import IdempotencyKey
from service.settings import Settings
from service.schemas import (
    MAX_ID,
    NO_NUL,
    JobCreate,
    JobDetail,
    JobEventsPage,
    JobPublic,
    JobsPage,
    ValidationPublic,
)
from service.states import IllegalTransition, JobStatus, move
from csx_config import JobSpec
from csx_config.keys import format_problems

router = APIRouter(prefix="/jobs", tags=["jobs"])
IdempotencyKeyHeader = Annotated[
    str | None, Header(alias="Idempotency-Key", max_length=255, description="replays are safe")
]


Parsed = tuple[dict[str, Any], JobCreate, ResolvedFiles]  # body, schema, files it reads


def _checked(data: dict[str, Any], settings: Settings, session: Session,
             user: Caller) -> Parsed:
    """Validate a submission and resolve the files it reads (database queries: in a thread)."""
    job_in = validate(JobCreate, data)
    try:
        files = check_submission(job_in, job_in.params, settings, session=session,
                                 caller=user)
    except SubmissionError as err:
        raise unprocessable(err.problems) from None
    return data, job_in, files


async def _parse_job(request: Request, settings: SettingsDep, session: SessionDep,
                     user: CurrentUser) -> Parsed:
    data = nest_params(await read_mapping(request), JobCreate)
    return await run_in_threadpool(_checked, data, settings, session, user)


# Validation builds a model with torch (up to seconds): its handler is a plain function so that
# FastAPI runs it in the thread pool instead of blocking the event loop for everyone.
ParsedJob = Annotated[Parsed, Depends(_parse_job)]


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobPublic,
             openapi_extra=request_body_openapi("JobCreate"),
             responses={409: {"description": "Idempotency-Key reused with another body"}})
async def submit_job(parsed: ParsedJob, session: SessionDep, user: CurrentUser,
                     settings: SettingsDep, scheduler: SchedulerDep,
                     idempotency_key: IdempotencyKeyHeader = None) -> Response:
    # The body is read on the event loop; validating and storing it (database round trips on
    # PostgreSQL) happen in the thread pool, where waiting holds up no other request.
    answer = await run_in_threadpool(_store, parsed, session, user, settings, idempotency_key)
    scheduler.wake()
    return answer


def _store(parsed: Parsed, session: Session, user: Caller, settings: Settings,
           idempotency_key: str | None) -> Response:
    data, job_in, files = parsed
    body_hash = crud.request_hash(data)
    if idempotency_key is not None:
        replay = _replay(session, user, idempotency_key, body_hash)
        if replay is not None:
            return replay
    fields = job_fields(job_in, job_in.params, settings, name=job_in.name, files=files)
    job = crud.add_job(session, owner=user, **fields)
    public = job_public(job, user.name, settings, crud.queue_position(session, job=job))
    if idempotency_key is not None:
        session.add(IdempotencyKey(owner_id=user.id, key=idempotency_key, request_hash=body_hash,
                                   job_id=job["id"], response=public.model_dump(mode="json")))
    try:
        session.commit()
    except IntegrityError:
        # A concurrent request with the same key won the race: answer as a replay of it.
        session.rollback()
        replay = _replay(session, user, idempotency_key or "", body_hash)
        if replay is None:
            raise
        return replay
    return Response(public.model_dump_json(), status.HTTP_201_CREATED,
                    headers={"Location": f"/v1/jobs/{job['id']}"}, media_type="application/json")


def _replay(session: SessionDep, user: CurrentUser, key: str, body_hash: str) -> Response | None:
    stored = crud.find_idempotency_key(session, owner=user, key=key)
    if stored is None:
        return None
    if stored.request_hash != body_hash:
        raise HTTPException(status.HTTP_409_CONFLICT,
                            f"Idempotency-Key {key!r} was already used with a different body")
    return JSONResponse(stored.response, status.HTTP_201_CREATED,
                        headers={"Location": f"/v1/jobs/{stored.job_id}",
                                 "Idempotent-Replayed": "true"})


@router.post(":validate", response_model=ValidationPublic,
             openapi_extra=request_body_openapi("JobCreate"))
def validate_job(parsed: ParsedJob, user: CurrentUser) -> ValidationPublic:
    """The --validate_only plan for a submission, without queueing it (loads torch)."""
    _, job_in, _ = parsed
    num_csx = resolve_num_csx(job_in, job_in.params)
    from training.plan import plan_job
    from training.report import plan_report

    try:
        plan = plan_report(plan_job(job_in.params, num_csx))
    except (ValueError, TypeError) as err:
        raise unprocessable([(("params",), str(err))]) from None
    except (RuntimeError, MemoryError) as err:
        # torch refusing to build the model (say, an absurd size) is the spec's fault too.
        message = f"the model cannot be built: {type(err).__name__}: {str(err)[:500]}"
        raise unprocessable([(("params", "model"), message)]) from None
    return ValidationPublic(valid=True, num_csx=num_csx, plan=plan)


@router.get("", response_model=JobsPage)
def list_jobs(
    session: SessionDep, user: CurrentUser, settings: SettingsDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: Annotated[int | None, Query(ge=1, le=MAX_ID, description=(
        "next_cursor of the previous page: jobs older than that job id"))] = None,
    status_: Annotated[JobStatus | None, Query(alias="status")] = None,
    experiment: Annotated[str | None, Query(max_length=200, pattern=NO_NUL)] = None,
    owner: Annotated[str | None, Query(max_length=100, pattern=NO_NUL,
                                       description="token name")] = None,
) -> JobsPage:
    jobs, next_cursor = crud.list_jobs(session, owner=user, limit=limit, cursor=cursor,
                                       status=status_, experiment=experiment, owner_name=owner)
    data = to_public_list(session, jobs, settings)
    return JobsPage(data=data, count=len(data), next_cursor=next_cursor)


@router.get("/{job_id:id}", response_model=JobDetail)
def get_job(job: OwnedJob, session: SessionDep, settings: SettingsDep) -> JobDetail:
    return to_detail(session, job, settings)


@router.get("/{job_id:id}/events", response_model=JobEventsPage)
def get_job_events(job: OwnedJob) -> JobEventsPage:
    return JobEventsPage.model_validate({"data": job.events, "count": len(job.events)})


@router.get("/{job_id:id}/logs", response_class=PlainTextResponse)
def get_job_logs(job: OwnedJob, settings: SettingsDep,
                 tail: Annotated[int, Query(ge=1, le=100_000)] = 1000) -> StreamingResponse:
    """The log's last `tail` lines, streamed (its database slot is free before it is sent)."""
    return StreamingResponse(joblogs.tail(joblogs.job_dir(settings.runs_dir, job.id,
                                                          job.run_key), tail),
                             media_type="text/plain; charset=utf-8")


@router.post("/{job_id:id}:cancel", status_code=status.HTTP_202_ACCEPTED,
             response_model=JobPublic, responses={409: {"description": "illegal transition"}})
def cancel_job(job: OwnedJob, user: CurrentUser, session: SessionDep, settings: SettingsDep,
               scheduler: SchedulerDep) -> JobPublic:
    def target(current: JobStatus) -> JobStatus | None:
        # Nothing runs for a queued job, so it is cancelled at once; others stop via
        # CANCELLING, and one stopping already needs nothing more.
        if current is JobStatus.CANCELLING:
            return None
        return JobStatus.CANCELLED if current is JobStatus.QUEUED else JobStatus.CANCELLING

    _move(session, job, target, f"cancel requested by {user.name}", settings)
    scheduler.wake()
    return to_public(session, job, settings)


@router.post("/{job_id:id}:retry", status_code=status.HTTP_202_ACCEPTED,
             response_model=JobPublic, responses={409: {"description": "illegal transition"}})
def retry_job(job: OwnedJob, session: SessionDep, settings: SettingsDep,
              scheduler: SchedulerDep) -> JobPublic:
    """Queue a failed or cancelled job again, if its stored params still validate and fit
    the cluster's memory."""
    try:
        spec = JobSpec.model_validate(job.params)
    except ValidationError as err:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id} cannot run again: its "
                            f"stored params no longer validate ({format_problems(err)}); "
                            "submit them again as they are meant now") from None
    problems = memory_problems(spec, job.num_csx, settings)
    if problems:
        raise unprocessable(problems, prefix=("job",))
    _move(session, job, lambda _: JobStatus.QUEUED, f"retry (attempt {job.attempt + 1})",
          settings)
    scheduler.wake()
    return to_public(session, job, settings)


# A request's move retried when the scheduler moved the job between its read and its write.
MOVE_TRIES = 5


def _move(session: SessionDep, job: Any, target: Callable[[JobStatus], JobStatus | None],
          message: str, settings: SettingsDep) -> None:
    """Move the job to `target(its status)` (None: nothing to do). When the scheduler moved
    it meanwhile (optimistic locking), read it again and decide again: a cancel racing the
    job's start used to answer 409 and leave the job to run."""
    for _ in range(MOVE_TRIES):
        to = target(JobStatus(job.status))
        if to is None:
            return
        try:
            move(session, job, to, message=message,
                 mlflow_tracking_uri=settings.mlflow_tracking_uri)
            session.commit()
            return
        except IllegalTransition as err:
            session.rollback()
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from None
        except StaleDataError:
            session.rollback()  # expires the job: the next read is the database's
    raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id} kept changing state; read "
                                                  "it and try again")
