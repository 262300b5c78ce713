"""Dependencies as named types: a handler's signature says what it needs.

Those that ask the database are plain functions, which FastAPI runs in the thread pool: on
PostgreSQL each query is a network round trip (two with the pool's pre-ping), and an `async`
dependency waiting on it on the event loop held up every other request meanwhile (50 clients
over every route: p99 seconds). A request gets its session only after taking one of
`db_pool_size` slots (an async wait, bounded by `db_wait_s`, then 503), and the API's pool
holds as many connections, so a thread that has a session always finds a free connection:
without the slots, requests in the thread pool held every connection and the event loop,
waiting for one, deadlocked the server at 20 concurrent requests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import anyio
from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session
from starlette.convertors import Convertor, register_url_convertor

from service import crud
from service.crud import Caller
from service.models import Job, Study
from service.schemas import MAX_ID
from service.scheduler import Scheduler
from service.settings import Settings

class IdConvertor(Convertor[int]):
    """`{job_id:id}` in a route: a run of digits. Starlette's `int` convertor converted it with
    int(), which refuses more than 4,300 digits (an 8,000-digit id answered 500); one with more
    digits than MAX_ID has is read as MAX_ID + 1, which `ResourceId` refuses (422)."""

    regex = "[0-9]+"

    def convert(self, value: str) -> int:
        return int(value) if len(value) <= len(str(MAX_ID)) else MAX_ID + 1

    def to_string(self, value: int) -> str:
        return str(value)


register_url_convertor("id", IdConvertor())  # before the route modules define their paths
ResourceId = Annotated[int, Path(ge=1, le=MAX_ID)]
bearer = HTTPBearer(auto_error=False, description="a token from `csx token create`")


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_scheduler(request: Request) -> Scheduler:
    return request.app.state.scheduler


async def get_session(request: Request) -> AsyncIterator[Session]:
    slots = request.app.state.db_slots
    wait_s = request.app.state.settings.db_wait_s
    with anyio.move_on_after(wait_s) as waited:
        await slots.acquire()
    if waited.cancelled_caught:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE,
                            f"the service is busy: no database connection came free within "
                            f"{wait_s:g} s; retry", headers={"Retry-After": "1"})
    try:
        with request.app.state.sessionmaker() as session:
            yield session
    finally:
        slots.release()


SettingsDep = Annotated[Settings, Depends(get_settings)]
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
# Scope "function": the session closes and its slot comes free once the handler returned, not
# after the response was sent (a slow reader of a streamed log held a slot for as long).
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def get_current_user(
    request: Request,
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Caller:
    unauthorized = {"WWW-Authenticate": "Bearer"}
    if credentials is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "Not authenticated", unauthorized)
    limiter = request.app.state.auth_limiter
    client = request.client.host if request.client else "unknown"
    if (wait_s := limiter.retry_after_s(client)) is not None:
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS,
                            f"too many failed authentications from {client}; retry in {wait_s} s",
                            {"Retry-After": str(wait_s)})
    caller = crud.get_caller(session, secret=credentials.credentials)
    # End the read so the connection goes back to the pool while the request waits for its
    # body to arrive and be parsed (behind others' uploads); a plain record stays valid.
    session.rollback()
    if caller is None:
        limiter.failed(client)
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "Invalid token", unauthorized)
    return caller


CurrentUser = Annotated[Caller, Depends(get_current_user)]


def _visible(user: Caller, owner_id: int) -> bool:
    return user.is_admin or owner_id == user.id


def get_owned_job(job_id: ResourceId, session: SessionDep, user: CurrentUser) -> Job:
    """Load the job; 404 if it is missing or not the caller's (admins see every job): the same
    answer in both cases, so ids of other users' jobs are not revealed."""
    job = session.get(Job, job_id)
    if job is None or not _visible(user, job.owner_id):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"Job {job_id} not found")
    return job


def get_owned_study(study_id: ResourceId, session: SessionDep, user: CurrentUser) -> Study:
    study = session.get(Study, study_id)
    if study is None or not _visible(user, study.owner_id):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"Study {study_id} not found")
    return study


OwnedJob = Annotated[Job, Depends(get_owned_job)]
OwnedStudy = Annotated[Study, Depends(get_owned_study)]
