"""The same migrations and API on PostgreSQL (the private server of conftest's `postgres`)."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from service.main import create_app
from service.settings import Settings
from service_helpers import ScriptedLauncher, assert_schema_matches_models, job_body, make_token


def test_postgres_migrations_match_models(postgres_url: str) -> None:
    url = Settings(database_url=postgres_url).database_url
    assert url.startswith("postgresql+psycopg://")
    assert_schema_matches_models(url)


def test_postgres_api_round_trip(postgres_url: str, tmp_path: Path) -> None:
    settings = Settings(database_url=postgres_url, runs_dir=tmp_path / "runs", paused=True,
                        mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
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
        cancelled = client.post(f"/v1/jobs/{ids[0]}:cancel", headers=alice).json()
        assert cancelled["status"] == "CANCELLED" and cancelled["finished_at"].endswith("Z")
        assert client.post(f"/v1/jobs/{ids[0]}:cancel", headers=alice).status_code == 409
