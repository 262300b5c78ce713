"""POST /studies end to end on Ray: five algorithms at one sparsity on the tiny preset,
nested MLflow runs under one parent, and a report with a perplexity plot."""

from __future__ import annotations

import base64

import pytest
from fastapi.testclient import TestClient
from mlflow.tracking import MlflowClient

from service.main import create_app
from service.settings import Settings
from service_helpers import make_token, wait_for

ALGORITHMS = ["dense", "static", "set", "rigl", "granet"]
BASE = {
    "train_input": {"batch_size": 4, "seq_len": 16},
    "eval_input": {"batch_size": 4, "seq_len": 16},
    "model": {"preset": "tiny"},
    "runconfig": {"max_steps": 16, "eval_steps": 1, "log_steps": 8, "seed": 7},
}


@pytest.mark.slow
@pytest.mark.timeout(400)
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
        assert study["mlflow_run_id"] and study["mlflow_url"].endswith(study["mlflow_run_id"])

        def finished() -> dict | None:
            current = client.get(f"/v1/studies/{study['id']}", headers=alice).json()
            return current if current["status"] == "DONE" else None

        done = wait_for(finished, 360, "every study job to end")
        assert [j["status"] for j in done["jobs"]] == ["SUCCEEDED"] * 5, \
            [(j["name"], j["status_message"]) for j in done["jobs"]]

        details = [client.get(f"/v1/jobs/{j['id']}", headers=alice).json() for j in done["jobs"]]
        sections = {d["tags"]["csx.variant"]: d["params"]["sparsity"] for d in details}
        assert sections["dense"] is None and sections["static"]["sparsity"] == 0.8
        assert sections["granet"]["init_sparsity"] == 0.5 and sections["granet"]["sparsity"] == 0.8
        shared = [{k: v for k, v in d["params"].items() if k != "sparsity"} for d in details]
        assert all(s == shared[0] for s in shared), "seed, data and model are shared"

        mlflow = MlflowClient(service_settings.mlflow_tracking_uri)
        for job in done["jobs"]:
            tags = mlflow.get_run(job["mlflow_run_id"]).data.tags
            assert tags["mlflow.parentRunId"] == study["mlflow_run_id"]
            assert tags["csx.status"] == "SUCCEEDED"

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
        artifacts = {a.path for a in mlflow.list_artifacts(study["mlflow_run_id"])}
        assert {"study_report.json", "study_perplexity.png"} <= artifacts
        assert mlflow.get_run(study["mlflow_run_id"]).info.status == "FINISHED"
        other = make_token(client, "bob")
        assert client.get(f"/v1/studies/{study['id']}", headers=other).status_code == 403
