"""A finished study's report under concurrent requests, and for every variant name the API
accepts (issue 47 item 3): drawn once, never a 500, logged to the parent run once by the
scheduler."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from mlflow.tracking import MlflowClient

from service import run_tags, study_reports
from service.schemas import StudyReport
from service.study_reports import PERPLEXITY_FIGURE, RenderedReport
from service_helpers import ScriptedLauncher, wait_for, wait_status

PARAMS = {"train_input": {"batch_size": 8, "max_sequence_length": 16},
          "model": {"preset": "tiny"}, "runconfig": {"max_steps": 10}}


def _finished_study(client: TestClient, alice: dict[str, str], launcher: ScriptedLauncher,
                    names: list[str]) -> dict[str, Any]:
    variants = [{"name": name, "sparsity": {"algorithm": "static", "sparsity": 0.5 + i / 10}}
                for i, name in enumerate(names)]
    response = client.post("/v1/studies", json={"name": "s", "params": PARAMS,
                                                "variants": variants}, headers=alice)
    assert response.status_code == 201, response.text
    study = response.json()
    for i, job in enumerate(study["jobs"]):
        ppl = 20.0 + i
        launcher.handle_for(job["id"]).finish({
            "final_eval_perplexity": ppl, "best_eval_perplexity": ppl, "speedup_vs_dense": 1.5,
            "eval_history": [{"step": s, "loss": 4.0 - s / 10, "perplexity": ppl + 10 - s}
                             for s in (2, 6, 10)]})
        wait_status(client, alice, job["id"], "SUCCEEDED")
    return study


def _parent_run_when_logged(client: TestClient, alice: dict[str, str], study_id: int) -> Any:
    """The study's parent run once the scheduler logged its report and ended it."""
    uri = client.app.state.settings.mlflow_tracking_uri
    run_id = client.get(f"/v1/studies/{study_id}", headers=alice).json()["mlflow_run_id"]
    mlflow = MlflowClient(uri)

    def finished() -> Any:
        assert run_tags.flush(uri)
        run = mlflow.get_run(run_id)
        return run if run.info.status == "FINISHED" else None

    return wait_for(finished, 60, "the scheduler to log the report to the parent run")


def test_eight_clients_on_a_finished_studys_report_get_one_drawing(
        client: TestClient, alice: dict[str, str], launcher: ScriptedLauncher,
        monkeypatch: Any) -> None:
    """8 clients at once used to draw the figures 8 times in parallel (matplotlib's text
    layout is not thread-safe: 500s) and each finished-study GET wrote to MLflow."""
    study = _finished_study(client, alice, launcher, ["static-a", "static-b"])
    drawings = []
    render = study_reports._render
    monkeypatch.setattr(study_reports, "_render",
                        lambda s: drawings.append(s.id) or render(s))

    def ask(i: int) -> tuple[int, bytes]:
        path = f"/v1/studies/{study['id']}/report" + (".png" if i % 2 else "")
        answer = client.get(path, headers=alice)
        return answer.status_code, answer.content if i % 2 else answer.json()["png_base64"]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(32)))
    assert {code for code, _ in answers} == {200}, [c for c, _ in answers]
    assert len({body for i, (_, body) in enumerate(answers) if i % 2}) == 1
    assert drawings.count(study["id"]) <= 1  # the scheduler's logging may have drawn it first
    parent = _parent_run_when_logged(client, alice, study["id"])
    mlflow = MlflowClient(client.app.state.settings.mlflow_tracking_uri)
    for key in ("final_ppl_mean/static-a", "final_ppl_mean/static-b"):
        assert len(mlflow.get_metric_history(parent.info.run_id, key)) == 1


def test_variant_names_mlflow_refuses_as_metric_keys_still_report(
        client: TestClient, alice: dict[str, str], launcher: ScriptedLauncher) -> None:
    """`rigl #1` and `a/../b` trained, but the report answered 500 every time: MLflow refused
    `final_ppl_mean/rigl #1` and `final_ppl_mean/a/../b` as metric keys."""
    study = _finished_study(client, alice, launcher, ["rigl #1", "a/../b", "rigl _1"])
    for path in ("report", "report.png"):
        assert client.get(f"/v1/studies/{study['id']}/{path}", headers=alice).status_code == 200
    parent = _parent_run_when_logged(client, alice, study["id"])
    assert {k for k in parent.data.metrics if k.startswith("final_ppl_mean/")} == {
        "final_ppl_mean/rigl _1", "final_ppl_mean/a_.._b", "final_ppl_mean/rigl _1_2"}


def test_a_report_another_process_drew_is_read_not_drawn_again(
        client: TestClient, alice: dict[str, str], launcher: ScriptedLauncher,
        monkeypatch: Any) -> None:
    """Each API worker and a restarted server drew a finished study's report again on its
    first request (50 clients: those waited 1-2.5 s). A drawing is written to the runs folder
    and read by a process that has none; a damaged one is drawn again; a new state's drawing
    replaces the study's older one."""
    study = _finished_study(client, alice, launcher, ["static-a", "static-b"])
    _parent_run_when_logged(client, alice, study["id"])  # the scheduler is done with it
    report = f"/v1/studies/{study['id']}/report"
    first = client.get(report, headers=alice).json()
    drawings = client.app.state.settings.runs_dir / study_reports.DRAWINGS
    (drawn,) = drawings.glob(f"study-{study['id']}-*.json")

    study_reports._kept.clear()  # what a process that has not drawn it holds
    monkeypatch.setattr(study_reports, "_render", lambda s: pytest.fail("drawn again"))
    assert client.get(report, headers=alice).json() == first
    png = client.get(report + ".png", headers=alice).content
    assert png == base64.b64decode(first["png_base64"])

    study_reports._kept.clear()
    drawn.write_text('{"report": {"variants": "torn')
    redrawn = []
    monkeypatch.setattr(study_reports, "_render",
                        lambda s: redrawn.append(s.id) or RenderedReport(
                            StudyReport.model_validate(first), {PERPLEXITY_FIGURE: png}))
    assert client.get(report, headers=alice).json() == first and redrawn == [study["id"]]

    older = drawings / f"study-{study['id']}-0123456789abcdef.json"
    older.write_text("{}")
    other_study = drawings / f"study-{study['id']}0-0123456789abcdef.json"
    other_study.write_text("{}")
    study_reports._kept.clear()
    drawn.unlink()
    client.get(report, headers=alice)
    assert sorted(drawings.glob("*.json")) == sorted([drawn, other_study])


@given(st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=8, unique=True))
def test_every_variant_gets_a_distinct_metric_name_mlflow_accepts(names: list[str]) -> None:
    from mlflow.utils.validation import _validate_metric_name

    keys = study_reports.metric_names(names)
    assert set(keys) == set(names) and len(set(keys.values())) == len(names)
    for key in keys.values():
        _validate_metric_name(f"final_ppl_mean/{key}")
