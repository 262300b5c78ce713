"""/mlflow/credentials: a user's own account on the MLflow server (service/mlflow_auth.py)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status

from service import crud
from service.api.deps import CurrentUser, SessionDep, SettingsDep
from service.mlflow_auth import MlflowUnavailable
from service.schemas import MlflowCredentials

router = APIRouter(prefix="/mlflow", tags=["mlflow"])


@router.get("/credentials", response_model=MlflowCredentials,
            responses={404: {"description": "MLflow is open on this service: no credentials"},
                       503: {"description": "the MLflow server cannot be reached"}})
def mlflow_credentials(session: SessionDep, user: CurrentUser,
                       settings: SettingsDep) -> MlflowCredentials:
    """Creates the caller's MLflow user if needed and lets it read the experiments of the
    caller's jobs and studies (what the scheduler grants as they start, caught up here)."""
    access = settings.mlflow_access
    if access is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            "MLflow has no authentication on this single-user service "
                            "(no CSX_MLFLOW_ADMIN_PASSWORD): open its UI without credentials")
    experiment_ids = crud.mlflow_experiment_ids(session, owner=user)
    session.rollback()  # the connection goes back to the pool while MLflow answers
    try:
        access.grant_read(user.name, experiment_ids)
    except MlflowUnavailable as err:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"{err}; retry shortly",
                            headers={"Retry-After": "5"}) from None
    except ValueError as err:
        raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from None
    return MlflowCredentials(username=user.name, password=access.password_for(user.name),
                             url=settings.mlflow_ui_url)
