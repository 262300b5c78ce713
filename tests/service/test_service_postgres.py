"""The same migrations and API on PostgreSQL (a private server on 127.0.0.1, started here)."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.main import create_app
from service.settings import Settings
from service_helpers import ScriptedLauncher, assert_schema_matches_models, job_body, make_token

PG_SCRIPT = Path(__file__).with_name("pg.sh")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    found = subprocess.run(["bash", str(PG_SCRIPT)], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.fail(f"PostgreSQL is required for this test and could not be installed: "
                    f"{found.stderr.strip()}")
    bin_dir = Path(found.stdout.strip().splitlines()[-1])
    # initdb refuses to run as root, so root runs the server as the `postgres` user.
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    data = Path(tempfile.mkdtemp(prefix="csx-pg-"))
    if as_user:
        user = pwd.getpwnam("postgres")
        os.chown(data, user.pw_uid, user.pw_gid)
    port = _free_port()
    subprocess.run([*as_user, str(bin_dir / "initdb"), "-D", str(data / "db"), "-U", "postgres",
                    "--auth=trust", "-E", "UTF8"], check=True, capture_output=True)
    subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data / "db"), "-w", "-l",
                    str(data / "log"), "-o", f"-p {port} -k {data} -c listen_addresses=127.0.0.1",
                    "start"], check=True, capture_output=True)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data / "db"), "-m", "fast",
                        "-w", "stop"], capture_output=True)
        shutil.rmtree(data, ignore_errors=True)


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
