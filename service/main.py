"""Build the FastAPI app and mount the API under /v1; never imports torch."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from service import crud
from service.api.body import PARSE_THREADS
from service.api.main import api_router
from service.db import make_engine, make_sessionmaker, upgrade_database
from service.limits import BodySizeLimit
from service.scheduler import Launcher, Scheduler
from service.schemas import JobCreate, StudyCreate
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
    app.state.body_parsers = anyio.CapacityLimiter(PARSE_THREADS)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.include_router(api_router, prefix=API_PREFIX)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The generated schema plus the bodies that routes parse themselves (JSON or YAML)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description=app.description)
        _, defs = models_json_schema([(JobCreate, "validation"), (StudyCreate, "validation")],
                                     ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
        app.openapi_schema = schema
    return app.openapi_schema


def _print_dev_token(app: FastAPI) -> None:
    with app.state.sessionmaker() as session:
        secret = crud.rotate_token(session, name=DEV_TOKEN_NAME, is_admin=True)
        session.commit()
    print(f"csx dev token (admin): {secret}", flush=True)


app = create_app()
