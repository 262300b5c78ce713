"""Build the FastAPI app and mount the API under /v1; never imports torch."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request, Response, status
from fastapi.responses import JSONResponse

from service import crud
from service.api.body import PARSE_THREADS
from service.api.main import api_router
from service.api.openapi import build_openapi
from service.db import make_engine, make_sessionmaker, upgrade_database
from service.limits import BodySizeLimit
from service.scheduler import Launcher, Scheduler
from service.settings import Settings

API_PREFIX = "/v1"
DEV_TOKEN_NAME = "dev"


def create_app(settings: Settings | None = None, *, launcher: Launcher | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.run_migrations_on_start:
            upgrade_database(settings.database_url)
        engine = make_engine(settings.database_url)
        app.state.sessionmaker = make_sessionmaker(engine)
        if settings.dev_token:
            _print_dev_token(app)
        # Stop what this lifespan started, even if another lifespan replaced app.state's.
        scheduler = app.state.scheduler = Scheduler(settings, app.state.sessionmaker, launcher)
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()
            engine.dispose()

    app = FastAPI(title="csx-sparse", version="1", lifespan=lifespan,
                  description="Submit and follow weight-sparse training jobs on a simulated "
                              "CS-2 cluster.")
    app.state.settings = settings
    app.state.body_parsers = {size: anyio.CapacityLimiter(threads)
                              for size, threads in PARSE_THREADS.items()}
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.include_router(api_router, prefix=API_PREFIX)
    app.openapi = lambda: app.openapi_schema or _cache_openapi(app)  # type: ignore[method-assign]
    app.add_exception_handler(status.HTTP_405_METHOD_NOT_ALLOWED, _method_not_allowed)
    return app


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


def _print_dev_token(app: FastAPI) -> None:
    with app.state.sessionmaker() as session:
        secret = crud.rotate_token(session, name=DEV_TOKEN_NAME, is_admin=True)
        session.commit()
    print(f"csx dev token (admin): {secret}", flush=True)


app = create_app()
