"""The same migrations and API on PostgreSQL (the private server of conftest's `postgres`)."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from service.main import create_app
from service.settings import Settings
from service_helpers import (
    PostgresServer,
    ScriptedLauncher,
    assert_schema_matches_models,
    job_body,
    make_token,
    wait_status,
)


def test_postgres_migrations_match_models(postgres_url: str) -> None:
    url = Settings(database_url=postgres_url).database_url
    assert url.startswith("postgresql+psycopg://")
    assert_schema_matches_models(url)


def test_postgres_api_round_trip(postgres_url: str, tmp_path: Path, mlflow_uri: str) -> None:
    settings = Settings(database_url=postgres_url, runs_dir=tmp_path / "runs", paused=True,
                        mlflow_tracking_uri=mlflow_uri)
    with TestClient(create_app(settings, launcher=ScriptedLauncher())) as client:
        alice = make_token(client, "pg-alice")
        key = {"Idempotency-Key": "pg-1"}
        ids = [client.post("/v1/jobs", json=job_body(priority=i), headers={**alice, **key} if i == 0
                           else alice).json()["id"] for i in range(5)]
        replay = client.post("/v1/jobs", json=job_body(priority=0), headers={**alice, **key})
        assert replay.json()["id"] == ids[0]
        page = client.get("/v1/jobs", params={"limit": 2}, headers=alice).json()
        second = client.get("/v1/jobs", params={"limit": 10, "cursor": page["next_cursor"]},
                            headers=alice).json()
        assert [j["id"] for j in page["data"] + second["data"]] == sorted(ids, reverse=True)
        positions = [client.get(f"/v1/jobs/{i}", headers=alice).json()["queue_position"]
                     for i in ids]
        assert positions == [5, 4, 3, 2, 1]  # higher priority first
        listed = client.get("/v1/jobs", headers=alice).json()["data"]  # one window query
        assert [j["queue_position"] for j in listed] == [1, 2, 3, 4, 5]
        cancelled = client.post(f"/v1/jobs/{ids[0]}:cancel", headers=alice).json()
        assert cancelled["status"] == "CANCELLED" and cancelled["finished_at"].endswith("Z")
        assert client.post(f"/v1/jobs/{ids[0]}:cancel", headers=alice).status_code == 409


def test_postgres_outage_mid_job_answers_503_and_loses_nothing(
        postgres: PostgresServer, tmp_path: Path, mlflow_uri: str) -> None:
    """The issue's outage: PostgreSQL stopped while a job runs and ends. Requests and healthz
    answer 503 (never 500) while it is away; once it is back, the job's outcome is recorded,
    its systems freed, and the queue behind it starts."""
    url = postgres.create_database("outage")
    settings = Settings(database_url=url, runs_dir=tmp_path / "runs", cluster_size=1,
                        mlflow_tracking_uri=mlflow_uri,
                        scheduler_interval_s=0.05, db_wait_s=5)
    launcher = ScriptedLauncher()
    with TestClient(create_app(settings, launcher=launcher), raise_server_exceptions=False) \
            as client:
        alice = make_token(client, "pg-outage")
        first = client.post("/v1/jobs", json=job_body(), headers=alice).json()["id"]
        second = client.post("/v1/jobs", json=job_body(), headers=alice).json()["id"]
        handle = launcher.handle_for(first)
        wait_status(client, alice, first, "RUNNING")
        postgres.stop_server()
        try:
            handle.finish({"steps": 10})
            health = client.get("/v1/healthz")
            assert health.status_code == 503 and health.json()["database"].startswith(
                "unavailable"), health.text
            answer = client.get(f"/v1/jobs/{first}", headers=alice)
            assert answer.status_code == 503 and "database" in answer.json()["detail"]
            assert answer.headers["Retry-After"]
        finally:
            postgres.start_server()
        done = wait_status(client, alice, first, "SUCCEEDED", timeout_s=120)
        assert done["result"] == {"steps": 10}
        launcher.handle_for(second, timeout_s=120).finish({})
        wait_status(client, alice, second, "SUCCEEDED", timeout_s=60)
        assert client.get("/v1/healthz").status_code == 200


def test_postgres_stores_every_name_the_api_accepts(postgres: PostgresServer, tmp_path: Path,
                                                     mlflow_uri: str) -> None:
    """A study's jobs are named `<study>/<variant>`, each part up to 200 characters: over
    varchar(200) in all, PostgreSQL refused the row (a 500). An experiment named only in the
    params' runconfig had no limit at all."""
    url = postgres.create_database("names")
    settings = Settings(database_url=url, runs_dir=tmp_path / "runs", paused=True,
                        mlflow_tracking_uri=mlflow_uri)
    with TestClient(create_app(settings, launcher=ScriptedLauncher())) as client:
        alice = make_token(client, "pg-names")
        study, variant = "s" * 200, "v" * 200
        body = {"name": study, "params": job_body()["params"], "seeds": [1, 2],
                "variants": [{"name": variant, "sparsity": {"algorithm": "static",
                                                            "sparsity": 0.5}}]}
        answer = client.post("/v1/studies", json=body, headers=alice)
        assert answer.status_code == 201, answer.text
        assert answer.json()["jobs"][0]["name"] == f"{study}/{variant}/seed1"
        long = job_body(runconfig={"max_steps": 10, "mlflow_experiment": "e" * 201})
        refused = client.post("/v1/jobs", json=long, headers=alice)
        assert refused.status_code == 422, refused.text
        assert refused.json()["detail"][0]["loc"] == ["body", "params", "runconfig",
                                                      "mlflow_experiment"]
