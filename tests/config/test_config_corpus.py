"""Every ModelZoo config of the corpus, unchanged, through `csx run --validate_only` and
`POST /v1/jobs:validate`: most validate, and each refused one is refused in one message that
names the unsupported feature(s) (tests/config/corpus.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from corpus import FILES, check_outcomes
from csx import cli


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The service with the data roots as ModelZoo files expect them: their relative data_dir
    (./language/datasets/...) under the service's working directory (and /cb), on a cluster whose
    systems hold any model (2^40 GiB each, where full-size activations run to PiB), so the
    test reads whether each file is valid; admission against this machine's memory is tested in
    tests/service/test_service_admission.py."""
    from service import crud
    from service.main import create_app
    from service.settings import Settings

    # One published file (Jais 30B phase 1, 2.2.1) names its data by absolute paths under /cb.
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'csx.db'}", runs_dir=tmp_path / "runs",
                        mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                        allowed_data_roots=[tmp_path, Path("/cb")], cluster_size=4,
                        memory_per_csx_gib=2.0**40)
    monkeypatch.chdir(tmp_path)
    with TestClient(create_app(settings)) as test_client:
        with test_client.app.state.sessionmaker() as session:
            _, secret = crud.create_token(session, name="alice", is_admin=False)
            session.commit()
        test_client.headers["Authorization"] = f"Bearer {secret}"
        yield test_client


def test_every_corpus_file_through_csx_run_validate_only_and_rest_validate(client: TestClient, capsys) -> None:
    """Both doors, file by file (the second answers from the report the first one's plan left,
    when the two read the file into the same plan)."""
    cli_outcomes: dict[Path, str | None] = {}
    rest_outcomes: dict[Path, str | None] = {}
    for path in FILES:
        code = cli.main(["run", "--params", str(path), "--validate_only"])
        captured = capsys.readouterr()
        assert code in (0, 2), (path, captured.err)
        if code == 0:
            assert "parameters" in captured.out, path  # the plan was printed
        cli_outcomes[path] = None if code == 0 else captured.err

        response = client.post("/v1/jobs:validate", json={"params": yaml.safe_load(path.read_text())})
        assert response.status_code in (200, 422), (path, response.text)
        if response.status_code == 200:
            assert response.json()["plan"]["layers"], path
            rest_outcomes[path] = None
        else:
            problems = response.json()["detail"]
            rest_outcomes[path] = "one response:\n" + "\n".join(
                f"  - {'.'.join(map(str, p['loc']))}: {p['msg']}" for p in problems)
    with capsys.disabled():
        check_outcomes(cli_outcomes, "csx run --validate_only")
        check_outcomes(rest_outcomes, "POST /v1/jobs:validate")
