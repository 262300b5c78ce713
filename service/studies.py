"""Studies: one base spec, several sparsity variants, a parent MLflow run, a comparison report."""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path
from typing import Any

from service.models import Study
from service.schemas import StudyCreate, StudyReport, StudyReportRow
from service.settings import Settings
from service.states import TERMINAL, JobStatus
from workers.spec import JobSpec

# Share of max_steps over which dynamic algorithms update masks (then masks stay fixed).
UPDATE_STOP_FRACTION = 0.75
UPDATES_PER_RUN = 10
GRANET_INIT_SPARSITY = 0.5
INITIAL_DROP_FRACTION = 0.3


def variant_sparsity(algorithm: str, level: float | None, max_steps: int) -> Any:
    """The `sparsity` section that runs `algorithm` at `level` in a run of `max_steps`."""
    if algorithm == "dense":
        return None
    if algorithm == "static":
        return {"algorithm": "static", "sparsity": level}
    stop = max(1, int(max_steps * UPDATE_STOP_FRACTION))
    update = {"freq": max(1, stop // UPDATES_PER_RUN), "stop": stop}
    # RigL's cosine decay (Evci et al. 2020): the last updates barely disturb the trained mask.
    drop_fraction = {"type": "cosine", "init": INITIAL_DROP_FRACTION, "half_period": stop}
    section = {"algorithm": algorithm, "sparsity": level, "update": update,
               "drop_fraction": drop_fraction}
    if algorithm == "granet":
        section["init_sparsity"] = min(GRANET_INIT_SPARSITY, level or 0.0)
    return section


def variants(study_in: StudyCreate) -> list[tuple[str, Any]]:
    """(variant name, sparsity section) for every job of the study."""
    if study_in.variants is not None:
        return [(v.name, v.sparsity) for v in study_in.variants]
    max_steps = study_in.params.runconfig.max_steps
    return [(name, variant_sparsity(name, study_in.sparsity, max_steps))
            for name in study_in.algorithms or []]


def variant_spec(base: JobSpec, sparsity: Any) -> JobSpec:
    """The base spec with another sparsity section; seed, data and model stay shared."""
    return JobSpec.model_validate({**base.model_dump(mode="json"), "sparsity": sparsity})


def open_parent_run(settings: Settings, study: Study) -> tuple[str, str]:
    """(experiment id, run id) of the study's parent run (loads torch via workers.tracking)."""
    from mlflow.tracking import MlflowClient

    from workers.tracking import create_run

    run_id = create_run(study.experiment, tracking_uri=settings.mlflow_tracking_uri,
                        run_name=study.name, tags={"csx.study_id": str(study.id)})
    return MlflowClient(settings.mlflow_tracking_uri).get_run(run_id).info.experiment_id, run_id


def study_status(study: Study) -> str:
    return "DONE" if all(JobStatus(j.status) in TERMINAL for j in study.jobs) else "RUNNING"


def build_report(settings: Settings, study: Study) -> StudyReport:
    rows, curves = [], {}
    for job in study.jobs:
        result = job.result or {}
        wall = result.get("job_wall_s")
        if wall is None and job.started_at and job.finished_at:
            wall = (job.finished_at - job.started_at).total_seconds()
        variant = job.tags.get("csx.variant", job.name)
        rows.append(StudyReportRow(
            job_id=job.id, variant=variant, status=job.status,
            final_eval_perplexity=result.get("final_eval_perplexity"),
            best_eval_perplexity=result.get("best_eval_perplexity"),
            projected_speedup=result.get("speedup_vs_dense"), wall_time_s=wall,
        ))
        history = result.get("eval_history") or []
        if history:
            curves[f"{variant} eval/perplexity"] = [(h["step"], h["perplexity"]) for h in history]
    complete = study_status(study) == "DONE"
    png = _curves_png(curves) if curves else None
    if complete and study.mlflow_run_id:
        _log_to_parent(settings, study.mlflow_run_id, rows, png)
    return StudyReport(study_id=study.id, complete=complete, rows=rows,
                       png_base64=base64.b64encode(png).decode() if png else None)


def _curves_png(curves: dict[str, list[tuple[int, float]]]) -> bytes:
    from workers.plots import write_curves_png

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "study_perplexity.png"
        write_curves_png(curves, path)
        return path.read_bytes()


def _log_to_parent(settings: Settings, run_id: str, rows: list[StudyReportRow],
                   png: bytes | None) -> None:
    """The finished report as artifacts of the parent run (rewritten on each request)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(settings.mlflow_tracking_uri)
    client.log_dict(run_id, {"rows": [r.model_dump() for r in rows]}, "study_report.json")
    if png is not None:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "study_perplexity.png"
            path.write_bytes(png)
            client.log_artifact(run_id, str(path))
    if client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id, "FINISHED")
