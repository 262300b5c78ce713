"""Guessing tokens is limited per client, and tokens can be listed and revoked (issue 47
item 6: 500 wrong tokens in 30 s all answered 401, and a token ended only when its row was
deleted by hand)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from service import crud
from service.limits import FailedAuthLimiter
from service_helpers import job_body, make_token


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_client_that_keeps_failing_to_authenticate_waits(client: TestClient,
                                                           alice: dict[str, str]) -> None:
    clock = Clock()
    client.app.state.auth_limiter = FailedAuthLimiter(10, 60.0, clock=clock)
    wrong = {"Authorization": "Bearer csx_guessed"}
    assert [client.get("/v1/jobs", headers=wrong).status_code for _ in range(10)] == [401] * 10
    limited = client.get("/v1/jobs", headers=wrong)
    assert limited.status_code == 429 and limited.headers["Retry-After"] == "60"
    # Nor is a right token looked at from there meanwhile: a guess would tell right from wrong.
    assert client.get("/v1/jobs", headers=alice).status_code == 429
    elsewhere = TestClient(client.app, client=("10.0.0.2", 4000))  # the app runs already
    assert elsewhere.get("/v1/jobs", headers=alice).status_code == 200
    clock.now += 30
    assert client.get("/v1/jobs", headers=alice).headers["Retry-After"] == "30"
    clock.now += 30  # the first failures leave the window
    assert client.get("/v1/jobs", headers=alice).status_code == 200
    assert client.get("/v1/healthz").status_code == 200  # no token, nothing limited


def test_a_revoked_token_stops_at_once_and_its_name_can_get_a_new_one(
        client: TestClient, alice: dict[str, str]) -> None:
    job_id = client.post("/v1/jobs", json=job_body(), headers=alice).json()["id"]
    admin = make_token(client, "root", admin=True)
    with client.app.state.sessionmaker() as session:
        crud.revoke_token(session, name="alice")
        session.commit()
    assert client.get("/v1/jobs", headers=alice).status_code == 401
    listed = client.get("/v1/jobs", headers=admin).json()["data"]
    assert [(j["id"], j["owner"]) for j in listed] == [(job_id, "alice")]  # her jobs stay hers
    again = make_token(client, "alice")
    assert client.get(f"/v1/jobs/{job_id}", headers=again).status_code == 200
    assert client.get("/v1/jobs", headers=alice).status_code == 401


def test_token_list_and_revoke_on_the_command_line(tmp_path, monkeypatch, capsys) -> None:
    from service.cli import main

    monkeypatch.setenv("CSX_DATABASE_URL", f"sqlite:///{tmp_path / 'csx.db'}")
    for name in ("carol", "dave"):
        assert main(["token", "create", "--name", name]) == 0
    assert main(["token", "revoke", "--name", "carol"]) == 0
    capsys.readouterr()
    assert main(["token", "list"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [(r[0], r[1], r[3].split()[0]) for r in rows] == [("carol", "user", "revoked"),
                                                             ("dave", "user", "active")]
    assert main(["token", "revoke", "--name", "erin"]) == 2
    assert "no token named 'erin'" in capsys.readouterr().err
