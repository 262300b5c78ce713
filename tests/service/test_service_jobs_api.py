"""POST/GET /v1/jobs: submission formats, validation errors, idempotency, pagination, auth."""

from __future__ import annotations

import json

import pytest
import yaml
from fastapi.testclient import TestClient

from service_helpers import job_body


def _paused(client: TestClient) -> None:
    client.app.state.settings.paused = True


def test_submit_job_json_returns_queued_job(client: TestClient, alice: dict[str, str]) -> None:
    _paused(client)
    response = client.post("/v1/jobs", json=job_body(num_csx=2, name="r1", priority=3), headers=alice)
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["status"] == "QUEUED" and job["queue_position"] == 1
    assert (job["name"], job["num_csx"], job["priority"], job["owner"]) == ("r1", 2, 3, "alice")
    assert job["attempt"] == 1 and job["created_at"].endswith("Z")
    assert response.headers["location"] == f"/v1/jobs/{job['id']}"
    detail = client.get(f"/v1/jobs/{job['id']}", headers=alice).json()
    assert detail["params"]["sparsity"]["algorithm"] == "rigl"
    # The submission answers from the INSERT's returned row, GET from the ORM: same view.
    assert {k: v for k, v in detail.items() if k not in ("params", "plan")} == job
    events = client.get(f"/v1/jobs/{job['id']}/events", headers=alice).json()
    assert [e["to_status"] for e in events["data"]] == ["QUEUED"]


def test_submit_job_yaml_flat_params_file(client: TestClient, alice: dict[str, str]) -> None:
    _paused(client)
    text = yaml.safe_dump({**job_body()["params"], "num_csx": 4, "mode": "train_and_eval",
                           "experiment": "yaml-exp", "tags": {"team": "x"}})
    response = client.post("/v1/jobs", content=text,
                           headers={**alice, "Content-Type": "application/yaml"})
    assert response.status_code == 201, response.text
    job = response.json()
    assert (job["num_csx"], job["mode"], job["experiment"], job["tags"]) == (
        4, "train_and_eval", "yaml-exp", {"team": "x"})


def test_num_csx_defaults_to_runconfig(client: TestClient, alice: dict[str, str]) -> None:
    _paused(client)
    body = job_body(runconfig={"max_steps": 10, "num_csx": 2})
    assert client.post("/v1/jobs", json=body, headers=alice).json()["num_csx"] == 2


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"sparsity": {"algorithm": "rigl", "sparsity": 1.0}}, "sparsity", "[0, 1)"),
    ({"sparsity": {"algorithm": "rigl", "sparsity": float("nan")}}, "sparsity", "nan"),
    ({"sparsity": {"algorithm": "magic", "sparsity": 0.5}}, "algorithm", "unknown algorithm"),
    ({"sparsity": {"algorithm": "static", "sparsity": {"type": "zigzag"}}}, "type", "schedule"),
    ({"sparsity": {"algorithm": "static", "sparsity": 0.5, "param_name_patterns": "(a+)+$"}},
     "param_name_patterns", "catastrophically"),
    ({"sparsity": {"param_name_patterns": {"(x*)*": 0.5}}}, "(x*)*", "catastrophically"),
    ({"num_csx": 0}, "num_csx", "greater than or equal to 1"),
    ({"num_csx": 5}, "num_csx", "exceeds the cluster"),
    ({"num_csx": 3}, "batch_size", "divide evenly"),
    ({"train_input": {"data_dir": "/etc"}}, "data_dir", "outside the allowed data roots"),
    ({"train_input": {"data_dir": "../../etc"}}, "data_dir", "outside the allowed data roots"),
    ({"mode": "dance"}, "mode", "train"),
    ({"model": {"preset": "galactic"}}, "preset", "tiny"),
    ({"runconfig": {"max_steps": 10, "bogus": 1}}, "runconfig", "bogus"),
    ({"timeout_s": -1}, "timeout_s", "greater than 0"),
])
def test_submit_bad_input_is_422_naming_field(client: TestClient, alice: dict[str, str],
                                              change: dict, field: str, words: str) -> None:
    body = job_body(**change)
    response = client.post("/v1/jobs", content=json.dumps(body),
                           headers={**alice, "Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    errors = response.json()["detail"]
    assert any(field in map(str, e["loc"]) and words in e["msg"] for e in errors), errors


@pytest.mark.parametrize(("content", "content_type", "status"), [
    (b"{not json", "application/json", 422),
    (b"- just\n- a list\n", "application/yaml", 422),
    (b"key: [unclosed", "application/yaml", 422),
    (b"<xml/>", "application/xml", 415),
])
def test_submit_unparseable_body_is_4xx(client: TestClient, alice: dict[str, str],
                                        content: bytes, content_type: str, status: int) -> None:
    response = client.post("/v1/jobs", content=content,
                           headers={**alice, "Content-Type": content_type})
    assert response.status_code == status, response.text


def test_body_over_limit_is_413(client: TestClient, alice: dict[str, str]) -> None:
    big = json.dumps(job_body(tags={"pad": "x"})) + " " * (10 * 1024 * 1024)
    response = client.post("/v1/jobs", content=big,
                           headers={**alice, "Content-Type": "application/json"})
    assert response.status_code == 413
    assert "exceeds" in response.json()["detail"]


def test_idempotency_key_replays_and_conflicts(client: TestClient, alice: dict[str, str],
                                               bob: dict[str, str]) -> None:
    _paused(client)
    key = {"Idempotency-Key": "abc-123"}
    first = client.post("/v1/jobs", json=job_body(name="once"), headers={**alice, **key})
    again = client.post("/v1/jobs", json=job_body(name="once"), headers={**alice, **key})
    assert first.status_code == again.status_code == 201
    assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
    other = client.post("/v1/jobs", json=job_body(name="twice"), headers={**alice, **key})
    assert other.status_code == 409 and "different body" in other.json()["detail"]
    # Keys are per owner: bob's identical key makes bob's own job.
    bobs = client.post("/v1/jobs", json=job_body(name="once"), headers={**bob, **key})
    assert bobs.status_code == 201 and bobs.json()["id"] != first.json()["id"]
    jobs = client.get("/v1/jobs", headers=alice).json()
    assert jobs["count"] == 1


def test_list_jobs_cursor_pagination_and_filters(client: TestClient, alice: dict[str, str],
                                                 bob: dict[str, str], admin: dict[str, str]) -> None:
    _paused(client)
    made = [client.post("/v1/jobs", json=job_body(experiment=f"e{i % 2}"), headers=alice).json()["id"]
            for i in range(7)]
    client.post("/v1/jobs", json=job_body(experiment="e0"), headers=bob)
    seen, cursor = [], None
    while True:
        page = client.get("/v1/jobs", params={"limit": 3, **({"cursor": cursor} if cursor else {})},
                          headers=alice).json()
        seen += [j["id"] for j in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(made, reverse=True)
    e1 = client.get("/v1/jobs", params={"experiment": "e1"}, headers=alice).json()
    assert [j["id"] for j in e1["data"]] == [m for m in reversed(made) if made.index(m) % 2 == 1]
    assert client.get("/v1/jobs", params={"status": "RUNNING"}, headers=alice).json()["count"] == 0
    assert client.get("/v1/jobs", params={"limit": 100}, headers=admin).json()["count"] == 8
    by_bob = client.get("/v1/jobs", params={"owner": "bob"}, headers=admin).json()
    assert [j["owner"] for j in by_bob["data"]] == ["bob"]
    bad = client.get("/v1/jobs", params={"cursor": "garbage!"}, headers=alice)
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "cursor"]
    assert client.get("/v1/jobs", params={"status": "NAPPING"}, headers=alice).status_code == 422


def test_auth_401_without_or_with_bad_token(client: TestClient) -> None:
    missing = client.get("/v1/jobs")
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    wrong = client.get("/v1/jobs", headers={"Authorization": "Bearer csx_nope"})
    assert wrong.status_code == 401 and wrong.json()["detail"] == "Invalid token"
    assert client.get("/v1/healthz").json()["status"] == "ok"


def test_someone_elses_job_is_404_like_a_missing_one(client: TestClient, alice: dict[str, str],
                                                      bob: dict[str, str],
                                                      admin: dict[str, str]) -> None:
    """Issue 12 item 5: 403 vs 404 told which job ids exist."""
    _paused(client)
    job_id = client.post("/v1/jobs", json=job_body(), headers=alice).json()["id"]
    for path in ("", "/events", "/logs"):
        hidden = client.get(f"/v1/jobs/{job_id}{path}", headers=bob)
        assert hidden.status_code == 404 and hidden.json()["detail"] == f"Job {job_id} not found"
    for action in (":cancel", ":retry"):
        assert client.post(f"/v1/jobs/{job_id}{action}", headers=bob).status_code == 404
    assert client.get(f"/v1/jobs/{job_id}", headers=admin).status_code == 200
    assert client.get("/v1/jobs", headers=bob).json()["count"] == 0
    missing = client.get("/v1/jobs/999999", headers=alice)
    assert missing.status_code == 404 and missing.json()["detail"] == "Job 999999 not found"


def test_queue_positions_follow_priority_then_fifo(client: TestClient, alice: dict[str, str]) -> None:
    _paused(client)
    low = client.post("/v1/jobs", json=job_body(priority=0), headers=alice).json()
    high = client.post("/v1/jobs", json=job_body(priority=5), headers=alice).json()
    low2 = client.post("/v1/jobs", json=job_body(priority=0), headers=alice).json()
    assert [j["queue_position"] for j in (low, high, low2)] == [1, 1, 3]  # at submission
    positions = {j["id"]: client.get(f"/v1/jobs/{j['id']}", headers=alice).json()["queue_position"]
                 for j in (low, high, low2)}
    assert positions == {high["id"]: 1, low["id"]: 2, low2["id"]: 3}
    # A listing reads every position in one query: the same places, a cancelled job none.
    client.post(f"/v1/jobs/{low['id']}:cancel", headers=alice)
    listed = {j["id"]: j["queue_position"] for j in client.get("/v1/jobs", headers=alice).json()["data"]}
    assert listed == {high["id"]: 1, low["id"]: None, low2["id"]: 2}


def test_cluster_reports_size_and_queue(client: TestClient, alice: dict[str, str]) -> None:
    _paused(client)
    client.post("/v1/jobs", json=job_body(), headers=alice)
    cluster = client.get("/v1/cluster", headers=alice).json()
    assert (cluster["size"], cluster["free"], cluster["queued"], cluster["paused"]) == (4, 4, 1, True)


def test_validate_returns_the_plan_without_queueing(client: TestClient,
                                                    alice: dict[str, str]) -> None:
    response = client.post("/v1/jobs:validate", json=job_body(num_csx=2), headers=alice)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["valid"] and result["num_csx"] == 2 and result["plan"]
    assert client.get("/v1/jobs", headers=alice).json()["count"] == 0
    bad = client.post("/v1/jobs:validate", json=job_body(optimizer={"optimizer_type": "NoSuchOptimizer"}),
                      headers=alice)
    assert bad.status_code == 422 and "NoSuchOptimizer" in bad.json()["detail"][0]["msg"]
