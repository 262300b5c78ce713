"""Issue 22: the service admits only what it can run and reads only what the caller may read.
Each test names the issue's item it covers."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.settings import Settings
from service_helpers import job_body


def _problems(response) -> list[tuple[list, str]]:
    assert response.status_code == 422, response.text
    return [(e["loc"], e["msg"]) for e in response.json()["detail"]]


def _paused(client: TestClient) -> None:
    client.app.state.settings.paused = True


# ---- item 2: tokenizer files are read only from where the caller may read --------------------
@pytest.fixture
def alices_tokenizer(client: TestClient, alice: dict[str, str],
                     service_settings: Settings) -> Path:
    """A tokenizer file in the folder of alice's job."""
    _paused(client)
    job_id = client.post("/v1/jobs", json=job_body(), headers=alice).json()["id"]
    folder = next(service_settings.runs_dir.glob(f"job-{job_id}*")) \
        if service_settings.runs_dir.exists() else None
    folder = folder or service_settings.runs_dir / f"job-{job_id}"
    path = folder / "model" / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"version": "1.0"}')
    return path


def _tokenizer_body(**files: str) -> dict:
    return job_body(model={"preset": "tiny", "tokenizer": {"type": "bpe", **files}})


@pytest.mark.parametrize("key", ["vocab_file", "merges_file"])
def test_tokenizer_files_outside_the_callers_area_all_read_the_same(
        client: TestClient, alice: dict[str, str], bob: dict[str, str],
        service_settings: Settings, alices_tokenizer: Path, key: str) -> None:
    inside = service_settings.allowed_data_roots[0] / "vocab.json"
    inside.write_text("{}")
    # The cases: a secret file, a missing file (the existence oracle), another user's
    # job folder; plus a missing file under the data root, traversal and a NUL byte.
    tried = ["/etc/shadow", "/etc/passwd", "/nonexistent/vocab.json", str(alices_tokenizer),
             str(inside.with_name("missing.json")), "../../../../etc/passwd", "a\x00b",
             str(service_settings.runs_dir), "x" * 100_000]
    answers = []
    for path in tried:
        files = {"vocab_file": str(inside), key: path}
        answers.append(_problems(client.post("/v1/jobs", json=_tokenizer_body(**files),
                                             headers=bob)))
    assert answers[0] == [(["body", "params", "model", "tokenizer", key],
                           "must name a file you may read: one under the allowed data roots "
                           "or in the folder of a job you can see")]
    assert all(answer == answers[0] for answer in answers), answers


def test_tokenizer_files_the_caller_may_read_are_stored_resolved(
        client: TestClient, alice: dict[str, str], service_settings: Settings,
        alices_tokenizer: Path) -> None:
    merges = service_settings.allowed_data_roots[0] / "merges.txt"
    merges.write_text("#version: 0.2\n")
    for files in ({"vocab_file": str(alices_tokenizer)},
                  {"vocab_file": str(alices_tokenizer), "merges_file": str(merges)}):
        response = client.post("/v1/jobs", json=_tokenizer_body(**files), headers=alice)
        assert response.status_code == 201, response.text
        stored = client.get(f"/v1/jobs/{response.json()['id']}", headers=alice).json()
        tokenizer = stored["params"]["model"]["tokenizer"]
        assert {k: tokenizer[k] for k in files} == {k: str(Path(v).resolve())
                                                    for k, v in files.items()}
