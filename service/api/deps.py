"""Dependencies as named types: a handler's signature says what it needs.

They are `async def` although their database reads are synchronous: each is one indexed query
(well under a millisecond), and a plain `def` dependency costs a round trip through the thread
pool, which measured as a large share of a submission's time under load (bench/api_load.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from service import crud
from service.crud import Caller
from service.models import Job, Study
from service.schemas import MAX_ID
from service.scheduler import Scheduler
from service.settings import Settings

ResourceId = Annotated[int, Path(ge=1, le=MAX_ID)]
bearer = HTTPBearer(auto_error=False, description="a token from `csx token create`")


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_scheduler(request: Request) -> Scheduler:
    return request.app.state.scheduler


async def get_session(request: Request) -> AsyncIterator[Session]:
    with request.app.state.sessionmaker() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
SessionDep = Annotated[Session, Depends(get_session)]


async def get_current_user(
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Caller:
    unauthorized = {"WWW-Authenticate": "Bearer"}
    if credentials is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "Not authenticated", unauthorized)
    caller = crud.get_caller(session, secret=credentials.credentials)
    # End the read so the connection goes back to the pool while the request waits for its
    # body to arrive and be parsed (behind others' uploads); a plain record stays valid.
    session.rollback()
    if caller is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "Invalid token", unauthorized)
    return caller


CurrentUser = Annotated[Caller, Depends(get_current_user)]


def _visible(user: Caller, owner_id: int) -> bool:
    return user.is_admin or owner_id == user.id


async def get_owned_job(job_id: ResourceId, session: SessionDep, user: CurrentUser) -> Job:
    """Load the job; 404 if it is missing or not the caller's (admins see every job): the same
    answer in both cases, so ids of other users' jobs are not revealed."""
    job = session.get(Job, job_id)
    if job is None or not _visible(user, job.owner_id):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"Job {job_id} not found")
    return job


async def get_owned_study(study_id: ResourceId, session: SessionDep, user: CurrentUser) -> Study:
    study = session.get(Study, study_id)
    if study is None or not _visible(user, study.owner_id):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"Study {study_id} not found")
    return study


OwnedJob = Annotated[Job, Depends(get_owned_job)]
OwnedStudy = Annotated[Study, Depends(get_owned_study)]
