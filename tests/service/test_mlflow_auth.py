"""MLflow behind its own authentication on a multi-user service (issue 32, fault 8): a real
`mlflow server --app-name basic-auth`, the service as its admin, one MLflow user per service
user, each reading only its own jobs' experiments."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from service import run_tags
from service.main import create_app
from service.mlflow_auth import CREDENTIALS_ENV, MlflowAccess
from service.settings import Settings
from service_helpers import ScriptedLauncher, job_body, make_token, start_auth_mlflow, wait_status

ADMIN = ("csx-service", "admin-password-for-tests")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One authenticating MLflow server for the module (it takes ~10-25 s to start)."""
    server, url = start_auth_mlflow(tmp_path_factory.mktemp("mlflow-auth"), ADMIN)
    try:
        yield url
    finally:
        server.stop()


def _without_credentials_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No MLflow credentials in this process's environment, and none left after the test
    (the service sets them when it starts: `setenv` first, so that the teardown removes them)."""
    for name in CREDENTIALS_ENV:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.fixture
def auth_client(mlflow_server: str, service_settings: Settings, launcher: ScriptedLauncher,
                monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    _without_credentials_env(monkeypatch)
    launcher.create_runs = True  # opens each job's run as the service (its admin account)
    settings = service_settings.model_copy(update={
        "mlflow_tracking_uri": mlflow_server, "mlflow_ui_url": mlflow_server,
        "mlflow_admin_username": ADMIN[0], "mlflow_admin_password": ADMIN[1]})
    settings = Settings.model_validate(settings.model_dump())  # validated like the environment
    settings.read_cluster_from(service_settings.cluster)  # the fixture's cluster, not a field
    with TestClient(create_app(settings, launcher=launcher)) as client:
        yield client


def _run_of(client: TestClient, headers: dict[str, str]) -> dict:
    response = client.post("/v1/jobs", json=job_body(experiment="same"), headers=headers)
    assert response.status_code == 201, response.text
    return wait_status(client, headers, response.json()["id"], "RUNNING")


def test_each_user_reads_only_their_own_runs(auth_client: TestClient, mlflow_server: str) -> None:
    alice, bob = make_token(auth_client, "alice"), make_token(auth_client, "bob")
    alices, bobs = _run_of(auth_client, alice), _run_of(auth_client, bob)
    assert run_tags.flush(mlflow_server)  # the grants the scheduler queued as the jobs started
    runs = f"{mlflow_server}/api/2.0/mlflow/runs"

    def read(run: dict, auth: tuple[str, str] | None) -> int:
        return httpx.get(f"{runs}/get", params={"run_id": run["mlflow_run_id"]}, auth=auth,
                         timeout=30).status_code

    credentials = auth_client.get("/v1/mlflow/credentials", headers=alice)
    assert credentials.status_code == 200, credentials.text
    mine = credentials.json()
    assert mine["username"] == "alice" and mine["url"] == mlflow_server
    as_alice = (mine["username"], mine["password"])
    assert read(alices, as_alice) == 200
    assert read(bobs, as_alice) == 403
    assert read(alices, None) == 401 and read(alices, ("alice", "guessed")) == 401
    # READ only: a user cannot delete even their own run behind the service's back.
    delete = httpx.post(f"{runs}/delete", json={"run_id": alices["mlflow_run_id"]},
                        auth=as_alice, timeout=30)
    assert delete.status_code == 403
    # The same experiment name is one experiment per user.
    experiment_ids = {httpx.get(f"{runs}/get", params={"run_id": run["mlflow_run_id"]},
                                auth=ADMIN, timeout=30).json()["run"]["info"]["experiment_id"]
                      for run in (alices, bobs)}
    assert len(experiment_ids) == 2
    as_bob = auth_client.get("/v1/mlflow/credentials", headers=bob).json()
    assert read(bobs, (as_bob["username"], as_bob["password"])) == 200
    assert as_bob["password"] != mine["password"]


def test_an_experiment_another_user_named_first_never_gets_the_users_runs(
        auth_client: TestClient, mlflow_server: str) -> None:
    """Bob creates `alice/squat` before Alice's first job there (MLflow lets any user create
    any experiment, and makes its creator its manager): her runs must not land in it."""
    alice, bob = make_token(auth_client, "alice"), make_token(auth_client, "bob")
    bobs = auth_client.get("/v1/mlflow/credentials", headers=bob).json()
    as_bob = (bobs["username"], bobs["password"])
    api = f"{mlflow_server}/api/2.0/mlflow"
    squat = httpx.post(f"{api}/experiments/create", json={"name": "alice/squat"}, auth=as_bob,
                       timeout=30)
    assert squat.status_code == 200, squat.text
    squatted = squat.json()["experiment_id"]

    jobs = []
    for _ in range(2):
        response = auth_client.post("/v1/jobs", json=job_body(experiment="squat"), headers=alice)
        assert response.status_code == 201, response.text
        jobs.append(wait_status(auth_client, alice, response.json()["id"], "RUNNING"))
    assert run_tags.flush(mlflow_server)
    homes = {httpx.get(f"{api}/runs/get", params={"run_id": job["mlflow_run_id"]}, auth=ADMIN,
                       timeout=30).json()["run"]["info"]["experiment_id"] for job in jobs}
    assert len(homes) == 1 and squatted not in homes  # one experiment, the service's own
    (home,) = homes
    assert all(f"/#/experiments/{home}/runs/" in job["mlflow_url"] for job in jobs)
    for job in jobs:
        run = {"run_id": job["mlflow_run_id"]}
        assert httpx.get(f"{api}/runs/get", params=run, auth=as_bob, timeout=30).status_code == 403
        assert httpx.post(f"{api}/runs/delete", json=run, auth=as_bob,
                          timeout=30).status_code == 403
    found = httpx.post(f"{api}/runs/search", json={"experiment_ids": [squatted]}, auth=as_bob,
                       timeout=30)
    assert found.status_code == 200 and found.json().get("runs", []) == []
    alices = auth_client.get("/v1/mlflow/credentials", headers=alice).json()
    assert httpx.get(f"{api}/runs/get", params={"run_id": jobs[0]["mlflow_run_id"]},
                     auth=(alices["username"], alices["password"]), timeout=30).status_code == 200


def test_credentials_say_mlflow_is_open_on_a_single_user_service(
        client: TestClient, alice: dict[str, str]) -> None:
    response = client.get("/v1/mlflow/credentials", headers=alice)
    assert response.status_code == 404 and "CSX_MLFLOW_ADMIN_PASSWORD" in response.text
    assert client.get("/v1/mlflow/credentials").status_code == 401


def test_credentials_answer_503_while_mlflow_is_away(service_settings: Settings,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _without_credentials_env(monkeypatch)
    settings = service_settings.model_copy(update={
        "mlflow_tracking_uri": "http://127.0.0.1:9", "mlflow_admin_password": ADMIN[1]})
    settings = Settings.model_validate(settings.model_dump())
    with TestClient(create_app(settings, launcher=ScriptedLauncher())) as client:
        response = client.get("/v1/mlflow/credentials", headers=make_token(client, "alice"))
    assert response.status_code == 503 and "cannot be reached" in response.text


def test_the_authenticating_server_answers_the_probe_jobs_wait_on(mlflow_server: str) -> None:
    from tracking.server import mlflow_unreachable

    assert mlflow_unreachable(mlflow_server) is None  # /health needs no account


def test_a_user_named_like_the_admin_account_gets_no_credentials(auth_client: TestClient) -> None:
    response = auth_client.get("/v1/mlflow/credentials",
                               headers=make_token(auth_client, ADMIN[0]))
    assert response.status_code == 409 and "CSX_MLFLOW_ADMIN_USERNAME" in response.text


def test_compose_runs_mlflow_with_authentication() -> None:
    import yaml

    root = Path(__file__).resolve().parents[2]
    compose = yaml.safe_load((root / "docker-compose.yml").read_text())
    mlflow = compose["services"]["mlflow"]
    assert "--app-name basic-auth" in mlflow["command"]
    env = mlflow["environment"]
    # No password shipped: compose refuses to start without one (${VAR:?message}).
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"].startswith("${CSX_MLFLOW_ADMIN_PASSWORD:?")
    config = root / env["MLFLOW_AUTH_CONFIG_PATH"].replace("/etc/mlflow/", "docker/")
    assert "default_permission = NO_PERMISSIONS" in config.read_text()
    api = compose["services"]["api"]["environment"]
    assert api["CSX_MLFLOW_ADMIN_PASSWORD"] == env["MLFLOW_AUTH_ADMIN_PASSWORD"]
    assert api["CSX_MLFLOW_ADMIN_USERNAME"] == env["MLFLOW_AUTH_ADMIN_USERNAME"]
    # Workers get the credentials per job (runtime env), not through their containers.
    worker = compose["services"]["ray-worker"]["environment"]
    assert not {"MLFLOW_TRACKING_PASSWORD", "CSX_MLFLOW_ADMIN_PASSWORD"} & set(worker)


def test_csx_serve_runs_its_ui_with_authentication_once_there_are_two_users(
        service_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    from service import crud
    from service.cli import with_ui_admin
    from service.db import make_engine, make_sessionmaker, upgrade_database
    from service.supervised import MlflowUI, SupervisedChild

    store = Path(service_settings.mlflow_tracking_uri.removeprefix("sqlite:///"))
    assert with_ui_admin(service_settings, store).mlflow_access is None  # no database yet
    upgrade_database(service_settings.database_url)
    engine = make_engine(service_settings.database_url)
    users = []
    for name in ("alice", "bob"):
        with make_sessionmaker(engine)() as session:
            crud.create_token(session, name=name)
            session.commit()
        users.append(with_ui_admin(service_settings, store).mlflow_access)
    engine.dispose()
    one, two = users
    assert one is None and two is not None  # one user: the UI stays open
    secret = store.parent / "mlflow-admin.secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert with_ui_admin(service_settings, store).mlflow_access == two  # kept across restarts

    started: dict = {}
    monkeypatch.setattr(SupervisedChild, "__init__",
                        lambda self, name, argv, **kw: started.update(argv=argv, env=kw["env"]))
    MlflowUI(store=store, url="http://127.0.0.1:5999", log_path=store.parent / "ui.log",
             access=two)
    assert started["argv"][-2:] == ["--app-name", "basic-auth"]
    env = started["env"]
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"] == two.admin_password
    assert "NO_PERMISSIONS" in Path(env["MLFLOW_AUTH_CONFIG_PATH"]).read_text()


def test_job_workers_get_the_services_mlflow_account_through_their_runtime_env(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.runner import _worker_runtime_env

    _without_credentials_env(monkeypatch)
    assert not set(CREDENTIALS_ENV) & set(_worker_runtime_env()["env_vars"])  # MLflow open
    MlflowAccess("http://mlflow:5000", *ADMIN).use_in_this_process()  # as the service's start
    env = _worker_runtime_env()["env_vars"]
    assert (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"]) == ADMIN
