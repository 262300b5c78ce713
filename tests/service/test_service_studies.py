"""POST /studies end to end on Ray: five algorithms at one sparsity on the tiny preset,
nested MLflow runs under one parent, and a report with a perplexity plot; what MLflow then
holds, read back through its client: run names, tags, step-0 masks, metric histories without
duplicates, the parent's artifacts, the comparison link's filter, figures without empty panels."""

from __future__ import annotations

import base64
import csv
from urllib.parse import parse_qs

import pytest
from fastapi.testclient import TestClient
from mlflow.tracking import MlflowClient

from service import run_tags
from service.main import create_app
from service.models import Study
from service.schemas import StudyReport
from service.settings import Settings
from service.studies import compare_link, study_figures
from tracking.plots import axes_hold_data
from tracking.tracker import LAYER_METRICS
from service_helpers import make_token, wait_for

ALGORITHMS = ["dense", "static", "set", "rigl", "granet"]
BASE = {
    "train_input": {"batch_size": 4, "max_sequence_length": 16},
    "eval_input": {"batch_size": 4, "max_sequence_length": 16},
    "model": {"preset": "tiny"},
    "runconfig": {"max_steps": 16, "eval_steps": 1, "log_steps": 4, "eval_frequency": 8,
                  "checkpoint_steps": 8, "seed": 7},
}
SPARSE = ALGORITHMS[1:]


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_study_runs_every_algorithm_and_reports(ray_session: None,
                                                service_settings: Settings) -> None:
    with TestClient(create_app(service_settings)) as client:
        alice = make_token(client, "alice")
        bad = client.post("/v1/studies", json={"name": "s", "params": BASE,
                                               "algorithms": ["rigl", "magic"], "sparsity": 0.9},
                          headers=alice)
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][:2] == ["body", "algorithms"]
        response = client.post("/v1/studies", json={"name": "five", "params": BASE,
                                                    "algorithms": ALGORITHMS, "sparsity": 0.8},
                               headers=alice)
        assert response.status_code == 201, response.text
        study = response.json()
        assert [j["tags"]["csx.variant"] for j in study["jobs"]] == ALGORITHMS
        assert study["mlflow_run_id"] is None  # opened by its first job's start, not the POST

        def finished() -> dict | None:
            current = client.get(f"/v1/studies/{study['id']}", headers=alice).json()
            return current if current["status"] == "DONE" else None

        # Five Ray jobs take ~30 s on an idle 2-core machine; the deadline is for a busy one.
        done = wait_for(finished, 900, "every study job to end")
        assert [j["status"] for j in done["jobs"]] == ["SUCCEEDED"] * 5, \
            [(j["name"], j["status_message"]) for j in done["jobs"]]
        study = done
        assert study["mlflow_run_id"] and study["mlflow_url"].endswith(study["mlflow_run_id"])

        details = [client.get(f"/v1/jobs/{j['id']}", headers=alice).json() for j in done["jobs"]]
        sections = {d["tags"]["csx.variant"]: d["params"]["sparsity"] for d in details}
        assert sections["dense"] is None and sections["static"]["sparsity"] == 0.8
        assert sections["granet"]["init_sparsity"] == 0.5 and sections["granet"]["sparsity"] == 0.8
        shared = [{k: v for k, v in d["params"].items() if k != "sparsity"} for d in details]
        assert all(s == shared[0] for s in shared), "seed, data and model are shared"

        mlflow = MlflowClient(service_settings.mlflow_tracking_uri)
        assert run_tags.flush(service_settings.mlflow_tracking_uri)
        for job in done["jobs"]:
            tags = mlflow.get_run(job["mlflow_run_id"]).data.tags
            assert tags["mlflow.parentRunId"] == study["mlflow_run_id"]
            assert tags["csx.status"] == "SUCCEEDED"
        check_variant_runs(mlflow, study, done["jobs"])

        report = client.get(f"/v1/studies/{study['id']}/report", headers=alice).json()
        assert report["complete"] and [r["variant"] for r in report["rows"]] == ALGORITHMS
        for row in report["rows"]:
            assert row["status"] == "SUCCEEDED" and row["final_eval_perplexity"] > 1
            assert row["best_eval_perplexity"] <= row["final_eval_perplexity"]
            assert row["wall_time_s"] > 0 and row["projected_speedup"] > 0
        png = base64.b64decode(report["png_base64"])
        assert png.startswith(b"\x89PNG")
        image = client.get(f"/v1/studies/{study['id']}/report.png", headers=alice)
        assert image.headers["content-type"] == "image/png" and image.content == png
        def logged() -> bool:  # by the scheduler, once every job ended
            assert run_tags.flush(service_settings.mlflow_tracking_uri)
            return mlflow.get_run(study["mlflow_run_id"]).info.status == "FINISHED"

        wait_for(logged, 60, "the report on the parent run")
        artifacts = {a.path for a in mlflow.list_artifacts(study["mlflow_run_id"])}
        assert {"study_report.json", "study_perplexity.png", "study_tradeoff.png",
                "study_summary.csv", "study_spec.json"} <= artifacts
        assert mlflow.get_run(study["mlflow_run_id"]).info.status == "FINISHED"
        check_parent_run(mlflow, study)
        with client.app.state.sessionmaker() as session:
            figures = study_figures(session.get(Study, study["id"]),
                                    StudyReport.model_validate(report))
        check_figures(figures)
        other = make_token(client, "bob")
        assert client.get(f"/v1/studies/{study['id']}", headers=other).status_code == 404


def check_variant_runs(mlflow: MlflowClient, study: dict, jobs: list[dict]) -> None:
    """Names, tags, params, step-0 masks and metric histories of every variant's run."""
    colours = set()
    for job in jobs:
        variant = job["tags"]["csx.variant"]
        run = mlflow.get_run(job["mlflow_run_id"])
        tags = run.data.tags
        assert run.info.run_name == variant
        assert (tags["csx.variant"], tags["csx.algorithm"]) == (variant, variant)
        assert tags["csx.study_id"] == str(study["id"]) and tags["csx.job_id"] == str(job["id"])
        colours.add(tags["mlflow.runColor"])
        assert run.data.params["runconfig.max_steps"] == "16"
        assert run.data.params["optimizer.weight_decay"] == "0.0"

        history = {key: [(m.step, m.value) for m in mlflow.get_metric_history(run.info.run_id, key)]
                   for key in run.data.metrics}
        for key, points in history.items():
            steps = [step for step, _ in points]
            assert len(steps) == len(set(steps)), f"{variant} {key}: duplicate steps {steps}"
        assert {"train/loss", "eval/loss", "eval/perplexity", "lr", "host/tokens_per_s",
                "perf/sim_tokens_per_s", "perf/sim_step_ms", "sparsity/global"} <= set(history)
        assert "perf/tokens_per_s" not in history  # the host's figure is no projection
        assert sorted(s for s, _ in history["train/loss"]) == [4, 8, 12, 16]
        assert sorted(s for s, _ in history["eval/perplexity"]) == [8, 16]
        if variant == "dense":
            assert history["sparsity/global"] == [(4, 0.0), (8, 0.0), (12, 0.0), (16, 0.0)]
            continue
        assert min(s for s, _ in history["sparsity/global"]) == 0  # the initial mask
        names = {a.path for a in mlflow.list_artifacts(run.info.run_id, "masks/step_0000000")}
        assert {"masks/step_0000000/masks.npz", "masks/step_0000000/density_hist.png"} <= names
        assert sum(n.endswith(".png") and "heatmap_" in n for n in names) >= 2, names
    assert len(colours) == len(jobs), "every variant has a colour of its own"

    granet = mlflow.get_run(jobs[ALGORITHMS.index("granet")]["mlflow_run_id"])
    assert granet.data.params["sparsity.init_sparsity"] == "0.5"
    assert granet.data.params["sparsity.drop_fraction.half_period"] == "12"
    targets = [k for k in granet.data.metrics if k.startswith(LAYER_METRICS["target"])]
    assert targets
    for key in targets:  # the cubic schedule from 50% to 80%, not the levels pruning reached
        points = dict((m.step, m.value) for m in mlflow.get_metric_history(
            granet.info.run_id, key))
        assert points[0] == pytest.approx(0.5) and points[16] == pytest.approx(0.8)


def check_parent_run(mlflow: MlflowClient, study: dict) -> None:
    """The parent holds the study (spec, report, table, figures), no per-step metrics, and a
    description linking the chart view of exactly this study's variants."""
    parent = mlflow.get_run(study["mlflow_run_id"])
    assert parent.info.run_name == "five" and parent.data.tags["csx.study_id"] == str(study["id"])
    per_step = ("train/", "eval/", "sparsity/", "weights/", "perf/", "host/", "mask/", "lr")
    assert not [k for k in parent.data.metrics if k.startswith(per_step)]
    # The report was requested twice (JSON, then PNG): its summary metrics are logged once.
    summary_keys = [k for k in parent.data.metrics if k.startswith("final_ppl_mean/")]
    assert sorted(k.split("/", 1)[1] for k in summary_keys) == sorted(ALGORITHMS)
    assert all(len(mlflow.get_metric_history(parent.info.run_id, k)) == 1 for k in summary_keys)
    experiment_id = parent.info.experiment_id
    link = compare_link(experiment_id, study["id"])
    assert link in parent.data.tags["mlflow.note.content"]
    assert link in mlflow.get_experiment(experiment_id).tags["mlflow.note.content"]
    search = parse_qs(link.split("?", 1)[1])["searchFilter"][0]
    found = mlflow.search_runs([experiment_id], search)
    assert sorted(r.info.run_name for r in found) == sorted(ALGORITHMS)
    summary = mlflow.download_artifacts(parent.info.run_id, "study_summary.csv")
    with open(summary, newline="") as table:
        rows = list(csv.DictReader(table))
    assert [r["variant"] for r in rows] == ALGORITHMS and all(float(r["final_eval_perplexity"]) > 1
                                                              for r in rows)


def check_figures(figures: dict) -> None:
    """Every panel of every study figure holds data; the curves cover all five variants."""
    assert set(figures) == {"study_perplexity.png", "study_tradeoff.png"}
    for name, figure in figures.items():
        assert figure.axes and all(axes_hold_data(a) for a in figure.axes), name
    loss, perplexity = figures["study_perplexity.png"].axes
    assert (loss.get_ylabel(), perplexity.get_ylabel()) == ("loss", "perplexity")
    assert len(loss.lines) == len(perplexity.lines) == len(ALGORITHMS)
    assert len(figures["study_tradeoff.png"].axes[0].collections) == len(ALGORITHMS)
