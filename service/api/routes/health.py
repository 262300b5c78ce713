"""/healthz and /cluster."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from service import crud
from service.api.deps import CurrentUser, SchedulerDep, SessionDep, SettingsDep
from service.schemas import ClusterPublic, ClusterSystem, Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz(session: SessionDep, scheduler: SchedulerDep) -> Health:
    """No auth: for load balancers and compose healthchecks."""
    session.execute(text("SELECT 1"))
    return Health(status="ok", database="ok",
                  scheduler="running" if scheduler.running else "stopped")


@router.get("/cluster", response_model=ClusterPublic)
def cluster(session: SessionDep, user: CurrentUser, settings: SettingsDep) -> ClusterPublic:
    held = crud.held_systems(session)
    size = settings.systems
    systems = [ClusterSystem(id=i, job_id=held.get(i)) for i in range(size)]
    return ClusterPublic(size=size, free=size - len(held),
                         paused=settings.paused, queued=crud.queued_count(session),
                         systems=systems)
