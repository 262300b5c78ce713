"""A study's report with its figures: drawn once per state of the study's jobs, never two at a
time, and logged to the study's parent MLflow run by the scheduler, never by a request.

Each `GET /v1/studies/{id}/report` (and `report.png`) used to draw the figures again in the
thread pool and, for a finished study, write them to MLflow: 8 clients on one study drew 8 at
once, and matplotlib's text layout is not thread-safe (its mathtext parser failed with
ParseException: 500s); each drawing costs about half a second of a core; and a GET waited on
MLflow, or logged the same metric points twice. Now a report is drawn under one lock for the
process, kept (the `MAX_KEPT` latest) until one of the study's jobs changes status, and the
requests that ask while it is drawn wait for that one drawing.

A drawing is also written to the runs folder (`study-reports/study-<id>-<state>.json`), and a
process that has not drawn a state reads it there: the scheduler draws a finished study's
report as it logs it, and each other API worker, and a restarted server, used to draw it again
on its first request (under 50 clients those waited 1-2.5 s, the route's p99).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import logging
import os
import re
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from service.models import Study
from service.schemas import StudyReport
from service.settings import Settings
from service.studies import build_report, study_figures

logger = logging.getLogger(__name__)
MAX_KEPT = 32
_METRIC_UNSAFE = re.compile(r"[^\w.\- :]")
MAX_METRIC_NAME = 200  # of MLflow's 250 characters a key may have, after `final_ppl_mean/`
PERPLEXITY_FIGURE = "study_perplexity.png"
DRAWINGS = "study-reports"  # in the runs folder: every process's drawings, for the others
REPORT_FILE = "report.json"


class RenderedReport(NamedTuple):
    report: StudyReport  # with png_base64, the perplexity figure
    figures: dict[str, bytes]  # PNG bytes by file name


_drawing = threading.Lock()  # matplotlib: one figure at a time in this process
_kept: OrderedDict[tuple, RenderedReport] = OrderedDict()
_kept_lock = threading.Lock()
_in_progress: dict[tuple, threading.Lock] = {}


def _state(study: Study) -> tuple:
    """What a report depends on: each job's status, attempt and end (results come with it)."""
    return study.id, tuple((job.id, job.status, job.attempt, job.finished_at)
                           for job in study.jobs)


def rendered_report(study: Study, runs_dir: Path) -> RenderedReport:
    """The study's report and figures, drawn if its jobs changed since the last drawing (in
    this process or, written to `runs_dir`, another)."""
    key = _state(study)
    with _kept_lock:
        if (kept := _kept.get(key)) is not None:
            _kept.move_to_end(key)
            return kept
        one_drawing = _in_progress.setdefault(key, threading.Lock())
    with one_drawing:
        with _kept_lock:
            if (kept := _kept.get(key)) is not None:
                return kept
        drawn = _drawing_file(runs_dir, study.id, key)
        rendered = _read(drawn)
        if rendered is None:
            rendered = _render(study)
            _write(drawn, rendered)
        with _kept_lock:
            _kept[key] = rendered
            while len(_kept) > MAX_KEPT:
                _kept.popitem(last=False)
            _in_progress.pop(key, None)
    return rendered


def _drawing_file(runs_dir: Path, study_id: int, key: tuple) -> Path:
    state = hashlib.sha256(repr(key).encode()).hexdigest()[:16]  # ids, statuses, datetimes
    return runs_dir / DRAWINGS / f"study-{study_id}-{state}.json"


def _read(path: Path) -> RenderedReport | None:
    """The drawing another process wrote to `path`, or None when there is none (yet)."""
    try:
        drawing = json.loads(path.read_bytes())
        return RenderedReport(StudyReport.model_validate(drawing["report"]),
                              {name: base64.b64decode(png) for name, png in drawing["figures"].items()})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(path: Path, rendered: RenderedReport) -> None:
    """Write the drawing in one file, whole (renamed into place), and remove the study's older
    ones; a failure costs other processes a drawing of their own, nothing else."""
    drawing = {"report": rendered.report.model_dump(mode="json"),
               "figures": {name: base64.b64encode(png).decode()
                           for name, png in rendered.figures.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{os.getpid()}.part")
        part.write_text(json.dumps(drawing))
        os.replace(part, path)
        for older in path.parent.glob(path.name.rsplit("-", 1)[0] + "-*.json"):
            if older != path:
                older.unlink(missing_ok=True)
    except OSError as err:
        logger.warning("study report not written to %s: %s", path, err)


def _render(study: Study) -> RenderedReport:
    from tracking.plots import save_figure

    report = build_report(study)
    with _drawing, tempfile.TemporaryDirectory(prefix="csx-report-") as folder:
        figures = {}
        for name, figure in study_figures(study, report).items():
            save_figure(figure, Path(folder) / name)
            figures[name] = (Path(folder) / name).read_bytes()
    if PERPLEXITY_FIGURE in figures:
        report.png_base64 = base64.b64encode(figures[PERPLEXITY_FIGURE]).decode()
    return RenderedReport(report, figures)


def metric_names(variants: list[str]) -> dict[str, str]:
    """Each variant's name as the last part of an MLflow metric key, distinct per variant.

    MLflow refuses a key with characters other than letters, digits, `_ - . : /` and space, or
    one that is not its own normalised path: a study of variants `rigl #1` or `a/../b` (which
    the API accepts: names are free text) failed to log its report. Others become `_`, a name
    of dots alone `_` too, and a name that meets one already taken gets a number appended."""
    names: dict[str, str] = {}
    for index, variant in enumerate(variants):
        name = _METRIC_UNSAFE.sub("_", variant)[:MAX_METRIC_NAME] or "_"
        if set(name) == {"."}:
            name = "_" * len(name)
        taken, suffix = set(names.values()), index
        while name in taken:
            name = f"{name[:MAX_METRIC_NAME - 12]}_{suffix}"
            suffix += len(variants)
        names[variant] = name
    return names


def log_to_parent_run(settings: Settings, sessions: sessionmaker[Session], study_id: int) -> None:
    """Log a finished study's report to its parent run and end the run, then record that it
    was (the scheduler queues this, service/run_tags.py, once every job of the study ended).
    A parent run that ended already is left as it is: done once."""
    with sessions() as session:
        study = session.get(Study, study_id)
        if study is None or study.mlflow_run_id is None:
            return
        rendered, run_id = rendered_report(study, settings.runs_dir), study.mlflow_run_id
    _log(settings, run_id, rendered)
    with sessions() as session:
        session.execute(update(Study).where(Study.id == study_id).values(report_logged=True))
        session.commit()


def _log(settings: Settings, run_id: str, rendered: RenderedReport) -> None:
    """The report as artifacts of the parent run, each variant's mean and sd over seeds as
    parent-run metrics, then the run terminated."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(settings.mlflow_tracking_uri)
    if client.get_run(run_id).info.status != "RUNNING":
        return
    report = rendered.report
    client.log_dict(run_id, report.model_dump(exclude={"png_base64"}), "study_report.json")
    keys = metric_names([summary.variant for summary in report.variants])
    for summary in report.variants:
        for stat, value in (("mean", summary.final_eval_perplexity_mean),
                            ("sd", summary.final_eval_perplexity_sd)):
            if value is not None:
                client.log_metric(run_id, f"final_ppl_{stat}/{keys[summary.variant]}", value)
    columns = ("variant", "seed", "status", "final_eval_perplexity", "best_eval_perplexity",
               "projected_speedup", "wall_time_s", "job_id")
    table = io.StringIO()
    csv.writer(table).writerows([columns, *([getattr(r, c) for c in columns] for r in report.rows)])
    client.log_text(run_id, table.getvalue(), "study_summary.csv")
    with tempfile.TemporaryDirectory(prefix="csx-report-") as folder:
        for name, png in rendered.figures.items():
            (Path(folder) / name).write_bytes(png)
            client.log_artifact(run_id, str(Path(folder) / name))
    client.set_terminated(run_id, "FINISHED")
