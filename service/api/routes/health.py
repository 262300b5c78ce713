"""/healthz and /cluster."""

from __future__ import annotations

from fastapi import APIRouter, Response, status
from sqlalchemy import text

from service import crud
from service.api.deps import CurrentUser, SchedulerDep, SessionDep, SettingsDep
from service.scheduler import DATABASE_UNAVAILABLE
from service.schemas import ClusterPublic, ClusterSystem, Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health,
            responses={503: {"model": Health, "description": "a dependency is failing"}})
def healthz(scheduler: SchedulerDep, response: Response) -> Health:
    """No auth: for load balancers and compose healthchecks. 503 names what is failing: the
    database (unreachable), or the scheduler (stopped, or stalled). A server standing by while
another one schedules this database is healthy: it serves the API.

    It asks the database through the scheduler's pool, not through a request slot: health must
    answer while the API's slots are all taken."""
    try:
        with scheduler.sessions() as session:
            session.execute(text("SELECT 1"))
        database = "ok"
    except DATABASE_UNAVAILABLE as err:
        database = f"unavailable: {type(err).__name__}: {str(err.orig or err).strip()[:200]}"
    health = Health(status="ok", database=database, scheduler=scheduler.health)
    if database != "ok" or health.scheduler in ("stalled", "stopped"):
        health.status = "unavailable"
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    return health


@router.get("/cluster", response_model=ClusterPublic)
def cluster(session: SessionDep, user: CurrentUser, settings: SettingsDep) -> ClusterPublic:
    held = crud.held_systems(session)
    size = settings.systems
    systems = [ClusterSystem(id=i, job_id=held.get(i)) for i in range(size)]
    # Held ids past `size` belong to systems a lost node took (their jobs give them back).
    return ClusterPublic(size=size, free=sum(i not in held for i in range(size)),
                         paused=settings.paused, queued=crud.queued_count(session),
                         systems=systems)
