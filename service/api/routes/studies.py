"""/studies: one base spec run as several sparsity variants, compared in a report."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from service import crud
from service.api.body import (
    nest_params,
    read_mapping,
    request_body_openapi,
    unprocessable,
    validate,
)
from service.api.deps import CurrentUser, OwnedStudy, SchedulerDep, SessionDep, SettingsDep
from service.crud import Caller
from service.full_size import full_size_request
from service.jobs import SubmissionError, check_submission, job_fields, mlflow_url, to_public_list
from service.schemas import StudyCreate, StudyPublic, StudyReport
from service.settings import Settings
from service.studies import study_jobs, study_status, variant_spec
from service.study_reports import PERPLEXITY_FIGURE, RenderedReport, rendered_report

router = APIRouter(prefix="/studies", tags=["studies"])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=StudyPublic,
             openapi_extra=request_body_openapi("StudyCreate"))
async def create_study(request: Request, session: SessionDep, user: CurrentUser,
                       settings: SettingsDep, scheduler: SchedulerDep) -> StudyPublic:
    body = nest_params(await read_mapping(request), StudyCreate)
    # Validating every variant and storing the study (database round trips) in the thread
    # pool: on the event loop they held up every other request meanwhile.
    study = await run_in_threadpool(_store, body, session, user, settings)
    scheduler.wake()
    return study


def _store(body: dict, session: Session, user: Caller, settings: Settings) -> StudyPublic:
    study_in = validate(StudyCreate, body)
    specs = []
    jobs = study_jobs(study_in)
    per_seed = len(jobs) // len(study_in.seeds or [None])
    for index, (name, seed, sparsity, batch_size, max_steps) in enumerate(jobs):
        try:
            spec = variant_spec(study_in.params, sparsity, seed, batch_size=batch_size,
                                max_steps=max_steps)
            files = check_submission(study_in, spec, settings, session=session, caller=user)
        except SubmissionError as err:
            where = "variants" if study_in.variants is not None else "algorithms"
            problems = [((where, index % per_seed, *loc), msg) for loc, msg in err.problems]
            raise unprocessable(problems) from None
        except ValueError as err:  # pydantic's ValidationError of the variant's section
            raise unprocessable([(("variants", index % per_seed, "sparsity"), str(err))]) from None
        specs.append((name, seed, spec, files))
    experiment = study_in.experiment or study_in.params.runconfig.mlflow_experiment
    study = crud.add_study(session, owner=user, name=study_in.name, experiment=experiment,
                           request=study_in.model_dump(mode="json") | full_size_request(body))
    # Its parent MLflow run is opened by the scheduler when its first job starts: a submission
    # never waits on MLflow (service/run_tags.py).
    for name, seed, spec, files in specs:
        suffix = "" if seed is None else f"/seed{seed}"
        fields = job_fields(study_in, spec, settings, name=f"{study_in.name}/{name}{suffix}",
                            files=files)
        fields["tags"] = {**fields["tags"], "csx.variant": name, "csx.study": study_in.name,
                          **({} if seed is None else {"csx.seed": str(seed)})}
        crud.add_job(session, owner=user, study_id=study.id, **fields)
    session.commit()
    session.refresh(study)
    return _public(session, study, settings)


@router.get("/{study_id:id}", response_model=StudyPublic)
def get_study(study: OwnedStudy, session: SessionDep, settings: SettingsDep) -> StudyPublic:
    return _public(session, study, settings)


@router.get("/{study_id:id}/report", response_model=StudyReport)
def get_study_report(study: OwnedStudy, session: SessionDep, settings: SettingsDep) -> StudyReport:
    """Final/best eval perplexity, projected CS-2 speed-up, wall time and status per variant,
    plus perplexity curves as a base64 PNG; logged to the parent run once all jobs end."""
    return _rendered(study, session, settings).report


@router.get("/{study_id:id}/report.png", response_class=Response,
            responses={200: {"content": {"image/png": {}}}, 404: {"description": "no curves yet"}})
def get_study_report_png(study: OwnedStudy, session: SessionDep, settings: SettingsDep) -> Response:
    png = _rendered(study, session, settings).figures.get(PERPLEXITY_FIGURE)
    if png is None:
        return Response(b'{"detail":"no evaluation has finished yet"}', status.HTTP_404_NOT_FOUND,
                        media_type="application/json")
    return Response(png, media_type="image/png")


def _rendered(study: OwnedStudy, session: SessionDep, settings: SettingsDep) -> RenderedReport:
    study.jobs  # noqa: B018 -- loaded now, kept by the closed session: the connection
    session.close()  # goes back to the pool before the drawing
    return rendered_report(study, settings.runs_dir)


def _public(session: SessionDep, study: OwnedStudy, settings: SettingsDep) -> StudyPublic:
    return StudyPublic(
        id=study.id, name=study.name, experiment=study.experiment, status=study_status(study),
        mlflow_run_id=study.mlflow_run_id,
        mlflow_url=mlflow_url(settings, study.mlflow_experiment_id, study.mlflow_run_id),
        created_at=study.created_at, jobs=to_public_list(session, study.jobs, settings),
    )
