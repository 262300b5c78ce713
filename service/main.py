"""Build the FastAPI app and mount the API under /v1; never imports torch."""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request, Response, status
from fastapi.responses import JSONResponse

from service import crud, heap
from service.api.body import PARSE_THREADS
from service.api.main import api_router
from service.api.openapi import build_openapi
from service.db import make_engine, make_sessionmaker, upgrade_database
from service.launcher import Launcher
from service.limits import BodySizeLimit, FailedAuthLimiter
from service.processes import term_on_parent_death
from service.scheduler import DATABASE_UNAVAILABLE, Scheduler
from service.settings import Settings

# Ray's C++ failure-signal handler, installed when the scheduler first joins Ray, takes SIGTERM
# from uvicorn's and aborts the process (rc -6) with its jobs marked nowhere: a graceful stop
# must reach the lifespan's shutdown instead. Ray reads this when it is imported.
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")

API_PREFIX = "/v1"
# How long the server keeps an idle keep-alive connection (uvicorn's default: 5 s). Clients
# keep idle connections for 5 s too (httpx's keepalive_expiry), so a request sent on one as the
# server closed it met a reset (50 clients: dozens). Longer than any client keeps them, the
# client closes first. `csx serve`, the Dockerfile and docker-compose.yml pass it.
KEEP_ALIVE_S = 75
# uvicorn kills a worker that answers no health ping for this long (its default: 5 s); one
# busy with a burst of requests on a loaded host is not hung. `csx serve` and
# docker-compose.yml pass it.
WORKER_HEALTHCHECK_S = 60
DEV_TOKEN_NAME = "dev"
# The scheduler thread and the job threads' short writes (queued, not failed, past this many).
SCHEDULER_CONNECTIONS = 16


def create_app(settings: Settings | None = None, *, launcher: Launcher | None = None,
               tune_collector: bool = False) -> FastAPI:
    """The app; `tune_collector` where it is the process's own (service/heap.py): a test that
    builds an app in its own process keeps the collector as it was."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.check_clear_of_ray_workers()
        if settings.api_workers > 1:
            # uvicorn's workers outlive a killed parent, holding the port and the lease.
            term_on_parent_death(os.getppid())
        if tune_collector:
            heap.tune_collection()
        if settings.run_migrations_on_start:
            upgrade_database(settings.database_url)
        if (mlflow_access := settings.mlflow_access) is not None:
            mlflow_access.use_in_this_process()
        # The API's pool: one connection per request slot (service/api/deps.py says why). The
        # scheduler and its job threads have their own, so neither can starve the other.
        engine = make_engine(settings.database_url, pool_size=settings.db_pool_size,
                             pool_timeout_s=settings.db_wait_s)
        scheduler_engine = make_engine(settings.database_url, pool_size=SCHEDULER_CONNECTIONS)
        app.state.sessionmaker = make_sessionmaker(engine)
        app.state.db_slots = anyio.Semaphore(settings.db_pool_size)
        # Stop what this lifespan started, even if another lifespan replaced app.state's.
        scheduler = app.state.scheduler = Scheduler(settings, make_sessionmaker(scheduler_engine),
                                                    launcher)
        try:
            scheduler.start()  # LeaseHeld if another server schedules this database
            if settings.dev_token:
                print_dev_token(app.state.sessionmaker)
            yield
        finally:
            scheduler.stop()
            engine.dispose()
            scheduler_engine.dispose()

    app = FastAPI(title="csx-sparse", version="1", lifespan=lifespan,
                  description="Submit and follow weight-sparse training jobs on a simulated "
                              "CS-2 cluster.")
    app.state.settings = settings
    app.state.body_parsers = {size: anyio.CapacityLimiter(threads)
                              for size, threads in PARSE_THREADS.items()}
    share = -(-settings.auth_failures_max // settings.api_workers)  # rounded up
    app.state.auth_limiter = FailedAuthLimiter(share, settings.auth_failures_window_s)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.include_router(api_router, prefix=API_PREFIX)
    app.openapi = lambda: app.openapi_schema or _cache_openapi(app)  # type: ignore[method-assign]
    app.add_exception_handler(status.HTTP_405_METHOD_NOT_ALLOWED, _method_not_allowed)
    for error in DATABASE_UNAVAILABLE:
        app.add_exception_handler(error, _database_unavailable)
    app.add_exception_handler(ConnectionError, _cluster_unavailable)
    return app


async def _cluster_unavailable(request: Request, exc: Exception) -> Response:
    """The Ray cluster named in RAY_ADDRESS cannot be reached (ray.init's ConnectionError)."""
    return JSONResponse({"detail": f"the Ray cluster is unavailable ({type(exc).__name__}: "
                                   f"{str(exc).strip()[:200]}); retry shortly"},
                        status.HTTP_503_SERVICE_UNAVAILABLE, headers={"Retry-After": "5"})


async def _database_unavailable(request: Request, exc: Exception) -> Response:
    """The database is down, restarting or saturated: the client may retry, nothing is lost."""
    reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0][:200]
    return JSONResponse({"detail": f"the database is unavailable ({type(exc).__name__}: "
                                   f"{reason}); retry shortly"},
                        status.HTTP_503_SERVICE_UNAVAILABLE, headers={"Retry-After": "2"})


def _cache_openapi(app: FastAPI) -> dict[str, Any]:
    app.openapi_schema = build_openapi(app)
    return app.openapi_schema


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    """405 whose Allow lists every method the OpenAPI document gives the path: Starlette names
    only those of the first route matching it (`Allow: POST` for /v1/jobs, which answers GET)."""
    allowed = set()
    for template, operations in request.app.openapi()["paths"].items():
        pattern = "[^/:]+".join(map(re.escape, re.split(r"\{[^}]*\}", template)))
        if re.fullmatch(pattern, request.url.path):
            allowed |= {method.upper() for method in operations}
    return JSONResponse({"detail": "Method Not Allowed"}, status.HTTP_405_METHOD_NOT_ALLOWED,
                        headers={"Allow": ", ".join(sorted(allowed))})


def print_dev_token(sessionmaker: Any) -> None:
    with sessionmaker() as session:
        secret = crud.rotate_token(session, name=DEV_TOKEN_NAME, is_admin=True)
        session.commit()
    print(f"csx dev token (admin): {secret}", flush=True)


app = create_app(tune_collector=True)  # `uvicorn service.main:app`
