"""Property-based API fuzzing from /openapi.json: no input, however odd, gets a 5xx."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from service.main import create_app
from service.settings import Settings
from service_helpers import ScriptedLauncher, make_token

MAX_EXAMPLES = 10  # per operation; 14 operations
# POST /v1/jobs, where the fuzzing found ten 500s (deep nesting, null bytes, `~user`,
# huge numbers), gets a run of its own: a few hundred bodies, well under a minute.
SUBMISSION_EXAMPLES = 200
FOLDER = Path(tempfile.mkdtemp(prefix="csx-fuzz-"))
# Built at import so schemathesis can read the schema; the lifespan runs in `auth` below.
app = create_app(Settings(
    database_url=f"sqlite:///{FOLDER / 'csx.db'}", runs_dir=FOLDER / "runs",
    mlflow_tracking_uri=f"sqlite:///{FOLDER / 'mlflow.db'}", paused=True,
    allowed_data_roots=[FOLDER],
), launcher=ScriptedLauncher())
schema = schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.fixture(scope="module")
def auth() -> Iterator[dict[str, str]]:
    with TestClient(app) as client:  # migrations, scheduler: the app as it serves
        yield make_token(client, "fuzzer", admin=True)
    shutil.rmtree(FOLDER, ignore_errors=True)


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case, auth: dict[str, str]) -> None:
    response = case.call(headers=auth)
    case.validate_response(response, checks=[not_a_server_error])


@schema.include(method="POST", path="/v1/jobs").parametrize()
@settings(max_examples=SUBMISSION_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_submission_gets_a_server_error(case: schemathesis.Case,
                                           auth: dict[str, str]) -> None:
    response = case.call(headers=auth)
    case.validate_response(response, checks=[not_a_server_error])


def test_schema_documents_every_route() -> None:
    paths = TestClient(app).get("/openapi.json").json()["paths"]
    body = paths["/v1/jobs"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"]["$ref"].endswith("/JobCreate")
    assert "application/yaml" in body
    assert {"/v1/jobs/{job_id}:cancel", "/v1/studies/{study_id}/report", "/v1/cluster"} <= set(paths)
