"""The /v1 router: one module per resource."""

from fastapi import APIRouter

from service.api.routes import health, jobs, mlflow, studies

api_router = APIRouter()
api_router.include_router(jobs.router)
api_router.include_router(studies.router)
api_router.include_router(health.router)
api_router.include_router(mlflow.router)
