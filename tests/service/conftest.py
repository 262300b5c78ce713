"""Service fixtures: an app on a throwaway SQLite database, tokens, a scripted launcher, and
one private PostgreSQL server per session for the tests that need the production database."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.cluster import machine_summary
from service.main import create_app
from service.settings import Settings
from service_helpers import PostgresServer, ScriptedLauncher, make_token


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server on 127.0.0.1 for the session (installed from Debian packages by
    tests/service/pg.sh when missing); each test uses or creates its own databases."""
    try:
        server = PostgresServer.start()
    except RuntimeError as err:
        pytest.fail(str(err))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres: PostgresServer) -> str:
    """The server's default database, as docker-compose.yml's CSX_DATABASE_URL names one."""
    return postgres.url()


@pytest.fixture(scope="session")
def empty_mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow SQLite store with its tables made: creating them takes MLflow 5-10 s, and
    every job the service starts creates its MLflow experiment (service/experiments.py)."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_uri(tmp_path: Path, empty_mlflow_store: Path) -> str:
    """A test's own MLflow store, its tables made already."""
    shutil.copyfile(empty_mlflow_store, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def service_settings(tmp_path: Path, mlflow_uri: str) -> Settings:
    """Four systems on four one-CPU nodes (this machine's memory and GPUs), so the scripted
    launcher's 1-system jobs run side by side whatever this machine's cores: on one node a
    1-system job takes every core by default and the scheduler starts the next when it ends."""
    (tmp_path / "data").mkdir()
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'csx.db'}",
        runs_dir=tmp_path / "runs",
        mlflow_tracking_uri=mlflow_uri,
        allowed_data_roots=[tmp_path / "data"],
        cluster_size=4,
        scheduler_interval_s=0.05,
    )
    four_nodes = replace(machine_summary(4), nodes=4, cpus_per_system=1.0)
    settings.read_cluster_from(lambda: four_nodes)
    return settings


@pytest.fixture
def launcher() -> ScriptedLauncher:
    return ScriptedLauncher()


@pytest.fixture
def client(service_settings: Settings, launcher: ScriptedLauncher) -> Iterator[TestClient]:
    with TestClient(create_app(service_settings, launcher=launcher)) as test_client:
        yield test_client


@pytest.fixture
def alice(client: TestClient) -> dict[str, str]:
    return make_token(client, "alice")


@pytest.fixture
def bob(client: TestClient) -> dict[str, str]:
    return make_token(client, "bob")


@pytest.fixture
def admin(client: TestClient) -> dict[str, str]:
    return make_token(client, "root", admin=True)
