"""Property-based API fuzzing from /openapi.json, on SQLite and on PostgreSQL: no input, however
odd, gets a 5xx, and the service answers as its OpenAPI document says (schemathesis's
conformance checks: documented status codes, response schemas and headers, Allow on 405,
schema-violating requests refused, schema-valid ones accepted, auth enforced)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance

from service.main import create_app
from service.schemas import MAX_ID
from service.settings import Settings
from service_helpers import ScriptedLauncher, make_token

MAX_EXAMPLES = 10  # per operation and backend; 14 operations
# POST /v1/jobs, where the issue's fuzzing found ten 500s (deep nesting, null bytes, `~user`,
# huge numbers), gets a run of its own: a few hundred bodies, well under a minute.
SUBMISSION_EXAMPLES = 200
# Whether these accept a body depends on more than its shape: the caller's files, the memory
# the model needs, the cluster's size. The schema cannot say it, so a 422 there is no failure.
SEMANTIC_BODIES = {("POST", "/v1/jobs"), ("POST", "/v1/jobs:validate"), ("POST", "/v1/studies")}


FOLDER = Path(tempfile.mkdtemp(prefix="csx-fuzz-"))
# One app, built at import so schemathesis can read its schema; `served` points its settings at
# one backend, then the other, and runs its lifespan (migrations, scheduler) on each.
SETTINGS = Settings(database_url=f"sqlite:///{FOLDER / 'csx.db'}", runs_dir=FOLDER / "runs",
                    mlflow_tracking_uri=f"sqlite:///{FOLDER / 'mlflow.db'}", paused=True,
                    allowed_data_roots=[FOLDER])
app = create_app(SETTINGS, launcher=ScriptedLauncher())
schema = schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def served(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """The app serving on one backend; an admin's token."""
    if request.param == "postgres":
        url = request.getfixturevalue("postgres").create_database("fuzz")
        SETTINGS.database_url = Settings(database_url=url).database_url  # the psycopg driver
    with TestClient(app) as client:
        yield make_token(client, "fuzzer", admin=True)


def _conforms(case: schemathesis.Case, auth: dict[str, str]) -> None:
    response = case.call(headers=auth)
    semantic = (case.method.upper(), case.path) in SEMANTIC_BODIES
    case.validate_response(response, headers=auth,
                           excluded_checks=[positive_data_acceptance] if semantic else None)


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_every_operation_conforms(case: schemathesis.Case, served: dict[str, str]) -> None:
    _conforms(case, served)


@schema.include(method="POST", path="/v1/jobs").parametrize()
@settings(max_examples=SUBMISSION_EXAMPLES, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_submissions_conform(case: schemathesis.Case, served: dict[str, str]) -> None:
    _conforms(case, served)


def test_schema_documents_what_the_issue_found_missing(served: dict[str, str]) -> None:
    auth, client = served, TestClient(app)
    paths = client.get("/openapi.json").json()["paths"]
    body = paths["/v1/jobs"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"]["$ref"].endswith("/JobCreate")
    assert "application/yaml" in body
    assert {"/v1/jobs/{job_id}:cancel", "/v1/studies/{study_id}/report", "/v1/cluster"} <= set(paths)
    # 404 was undocumented on the 8 operations that take an id.
    with_ids = [(path, method) for path, ops in paths.items() if "{" in path for method in ops]
    assert len(with_ids) == 8
    assert all("404" in paths[path][method]["responses"] for path, method in with_ids)
    # Allow named only POST for /v1/jobs, which answers GET too.
    for method in ("OPTIONS", "PUT", "DELETE"):
        response = client.request(method, "/v1/jobs", headers=auth)
        assert response.status_code == 405 and response.headers["allow"] == "GET, POST"
    # Any cursor the schema allows is accepted (`?cursor=000...` was refused).
    cursor = paths["/v1/jobs"]["get"]["parameters"]
    assert next(p for p in cursor if p["name"] == "cursor")["schema"]["anyOf"][0] == {
        "type": "integer", "minimum": 1, "maximum": MAX_ID}
    for value in (1, "0001", MAX_ID):
        assert client.get("/v1/jobs", params={"cursor": value}, headers=auth).status_code == 200
    # The study rule "exactly one of algorithms or variants" is in the schema.
    study = client.get("/openapi.json").json()["components"]["schemas"]["StudyCreate"]
    assert [branch["required"] for branch in study["oneOf"]] == [["variants"], ["algorithms"]]
