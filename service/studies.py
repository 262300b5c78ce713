"""Studies: one base spec, several sparsity variants, a parent MLflow run, a comparison report."""

from __future__ import annotations

import statistics
from collections import defaultdict
from itertools import combinations
from typing import Any, NamedTuple, Sequence
from urllib.parse import quote

from service.full_size import full_size_report
from service.experiments import find_run
from service.models import Job, Study
from service.schemas import (
    StudyCreate,
    StudyGap,
    StudyReport,
    StudyReportRow,
    StudyVariantSummary,
)
from service.settings import Settings
from service.states import TERMINAL, JobStatus
from csx_config import JobSpec

# Share of max_steps over which dynamic algorithms update masks (then masks stay fixed).
UPDATE_STOP_FRACTION = 0.75
UPDATES_PER_RUN = 10
GRANET_INIT_SPARSITY = 0.5
INITIAL_DROP_FRACTION = 0.3
# Cerebras' published perplexity orderings at 80% (lower first), as (better, worse) pairs:
# dense < RigL < SET < Static, and GraNet 50->80% below RigL.
PUBLISHED_PAIRS = (("dense", "rigl"), ("rigl", "set"), ("set", "static"), ("granet", "rigl"))


def _transitive(pairs: Sequence[tuple[str, str]]) -> frozenset[tuple[str, str]]:
    closure = set(pairs)
    while extra := {(a, d) for a, b in closure for c, d in closure if b == c} - closure:
        closure |= extra
    return frozenset(closure)


PUBLISHED_ORDER = _transitive(PUBLISHED_PAIRS)  # e.g. RigL < Static follows from the pairs
# One colour per variant, in study order (matplotlib's tab10), as the runs' `mlflow.runColor`
# tag and in the study figures: MLflow's own pick gave two of five variants the same colour.
VARIANT_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                   "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
# The parent run's description (MLflow shows it on the run page): how to compare.
COMPARE_NOTE = (
    "Study **{name}**: one nested run per variant, named after it, in its own colour, tagged "
    "`csx.variant`, `csx.algorithm`, `csx.study_id`, `csx.job_id`.\n\n"
    "**[Compare the variants]({link})**: the chart view of this study's variants only "
    "(eval/perplexity, eval/loss, train/loss, sparsity, projected CS-2 performance), best "
    "final perplexity first. With several seeds, *Group by* `csx.variant` there.\n\n"
    "Artifacts of this run: `study_report.json`, `study_summary.csv` (one row per variant and "
    "seed), `study_perplexity.png`, `study_tradeoff.png`, `study_spec.json`.")
# The experiment's description, kept only while csx wrote it (a user's own stays untouched).
EXPERIMENT_NOTE = "csx-sparse study **{name}**: [compare its variants]({link})."
NOTE_TAG = "mlflow.note.content"


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
    options = study_in.algorithm_options or {}
    sections = []
    for name in study_in.algorithms or []:
        section = variant_sparsity(name, study_in.sparsity, max_steps)
        if name in options:  # the schema admits options for sparse algorithms only
            section = {**section, **options[name]}
        sections.append((name, section))
    return sections


class StudyJob(NamedTuple):
    """One job of a study: a variant at a seed (None: the spec's own), with its sparsity
    section and, where the variant sets them, its own batch size and step count."""
    variant: str
    seed: int | None
    sparsity: Any
    batch_size: int | None = None
    max_steps: int | None = None


def study_jobs(study_in: StudyCreate) -> list[StudyJob]:
    """Every job: each variant once per seed of `seeds`, or once at runconfig.seed."""
    runs = {v.name: (v.batch_size, v.max_steps) for v in study_in.variants or []}
    return [StudyJob(name, seed, section, *runs.get(name, (None, None)))
            for seed in study_in.seeds or [None] for name, section in variants(study_in)]


# Step counts that scale with a variant's max_steps, so that a run twice as long follows the
# same learning-rate curve and evaluates, checkpoints and logs at the same tokens seen.
SCHEDULER_STEP_KEYS = ("total_iters", "step_size", "T_max", "warmup_steps")
RUNCONFIG_STEP_KEYS = ("eval_frequency", "checkpoint_steps", "log_steps")


def variant_spec(base: JobSpec, sparsity: Any, seed: int | None = None, *,
                 batch_size: int | None = None, max_steps: int | None = None) -> JobSpec:
    """The base spec with another sparsity section (and seed, batch size, step count); data
    and model stay shared. A different max_steps stretches the learning-rate schedule and the
    eval/checkpoint/log cadence by max_steps / the base's."""
    params = {**base.model_dump(mode="json"), "sparsity": sparsity}
    runconfig = dict(params["runconfig"])
    if seed is not None:
        runconfig["seed"] = seed
    if max_steps is not None and max_steps != base.runconfig.max_steps:
        ratio = max_steps / base.runconfig.max_steps
        for key in RUNCONFIG_STEP_KEYS:
            if runconfig.get(key):
                runconfig[key] = max(1, round(runconfig[key] * ratio))
        runconfig["max_steps"] = max_steps
        params["optimizer"] = {**params["optimizer"], "learning_rate": _stretched(
            params["optimizer"]["learning_rate"], ratio)}
    params["runconfig"] = runconfig
    if batch_size is not None:
        params["train_input"] = {**params["train_input"], "batch_size": batch_size}
    return JobSpec.model_validate(params)


NO_NOISE_ESTIMATE = "1 seed: no noise estimate"


def _stretched(rate: Any, ratio: float) -> Any:
    """A learning rate (number, scheduler or list of schedulers) over `ratio` times the steps."""
    if isinstance(rate, list):
        return [_stretched(item, ratio) for item in rate]
    if not isinstance(rate, dict):
        return rate  # a constant rate has no steps
    scaled = {key: (max(1, round(value * ratio)) if key in SCHEDULER_STEP_KEYS and value else value)
              for key, value in rate.items()}
    if scaled.get("milestones"):
        scaled["milestones"] = [round(m * ratio) for m in scaled["milestones"]]
    return scaled


def aggregate(rows: Sequence[StudyReportRow]) -> tuple[list[StudyVariantSummary], list[StudyGap]]:
    """Mean ± sd of the final eval perplexity per variant (over its seeds) and, for every pair
    of variants, the gap between their means and whether it exceeds seed noise (the larger of
    the two sds; none below 2 runs on a side), checked against the published order where there
    is one. Variants keep their first-seen order; a pair lists the lower mean first."""
    by_variant: dict[str, list[StudyReportRow]] = defaultdict(list)
    for row in rows:
        by_variant[row.variant].append(row)
    summaries = []
    for name, group in by_variant.items():
        ppl = [r.final_eval_perplexity for r in group if r.final_eval_perplexity is not None]
        speedups = [r.projected_speedup for r in group if r.projected_speedup is not None]
        summaries.append(StudyVariantSummary(
            variant=name, runs=len(ppl),
            final_eval_perplexity_mean=statistics.fmean(ppl) if ppl else None,
            final_eval_perplexity_sd=statistics.stdev(ppl) if len(ppl) > 1 else None,
            projected_speedup_mean=statistics.fmean(speedups) if speedups else None))
    measured = [s for s in summaries if s.final_eval_perplexity_mean is not None]
    gaps = []
    for a, b in combinations(measured, 2):
        better, worse = sorted((a, b), key=lambda s: s.final_eval_perplexity_mean)
        gap = worse.final_eval_perplexity_mean - better.final_eval_perplexity_mean
        noise = exceeds = None
        if min(better.runs, worse.runs) > 1:  # one run has no spread: nothing to compare with
            noise = max(better.final_eval_perplexity_sd, worse.final_eval_perplexity_sd)
            exceeds = gap > noise
        published = ("agrees" if (better.variant, worse.variant) in PUBLISHED_ORDER else
                     "disagrees" if (worse.variant, better.variant) in PUBLISHED_ORDER else None)
        gaps.append(StudyGap(better=better.variant, worse=worse.variant, gap=gap, noise=noise,
                             exceeds_noise=exceeds, verdict=gap_verdict(exceeds),
                             published=published))
    return summaries, gaps


def gap_verdict(exceeds_noise: bool | None) -> str:
    """How a report words a gap: never "within noise" when no noise could be estimated."""
    if exceeds_noise is None:
        return NO_NOISE_ESTIMATE
    return "real" if exceeds_noise else "within seed noise"


def open_parent_run(settings: Settings, study: Study, experiment_id: str) -> str:
    """The id of the study's parent run in its experiment (the service's own): the one a
    server stopped before recording it left there, else a new one (loads torch via
    tracking.tracker)."""
    from mlflow.tracking import MlflowClient

    from tracking.tracker import create_run

    identity = {"csx.study_id": str(study.id), "csx.role": "study"}
    run_id = find_run(settings, experiment_id, identity)
    if run_id is None:
        run_id = create_run(study.experiment, tracking_uri=settings.mlflow_tracking_uri,
                            run_name=study.name, tags=identity, experiment_id=experiment_id)
    client = MlflowClient(settings.mlflow_tracking_uri)
    link = compare_link(experiment_id, study.id)
    client.set_tag(run_id, NOTE_TAG, COMPARE_NOTE.format(name=study.name, link=link))
    note = client.get_experiment(experiment_id).tags.get(NOTE_TAG)
    if note is None or note.startswith(EXPERIMENT_NOTE.split("{", 1)[0]):
        client.set_experiment_tag(experiment_id, NOTE_TAG,
                                  EXPERIMENT_NOTE.format(name=study.name, link=link))
    client.log_dict(run_id, study.request, "study_spec.json")
    return run_id


def compare_link(experiment_id: str, study_id: int) -> str:
    """The MLflow UI route (after the UI's address) to the chart view of a study's variants.

    Filtering on the variants' tags keeps the parent run, which has no per-step metrics, out of
    every chart and legend; sorting by a metric instead of start time stops MLflow nesting the
    variants under a collapsed parent.
    """
    search = f"tags.`csx.study_id` = '{study_id}' and tags.`csx.role` = 'variant'"
    # workflowType: MLflow 3 otherwise shows its GenAI pages (traces, sessions) around the runs.
    return (f"#/experiments/{experiment_id}/runs?compareRunsMode=CHART"
            f"&orderByKey={quote('metrics.`eval/perplexity`')}&orderByAsc=true"
            f"&searchFilter={quote(search)}&workflowType=machine_learning")


def compare_url(parent_run_url: str, study_id: int) -> str:
    """`compare_link` as a full address, from the study's parent-run URL (its `mlflow_url`)."""
    ui, _, route = parent_run_url.partition("/#/experiments/")
    return f"{ui}/{compare_link(route.split('/', 1)[0], study_id)}"


def variant_colour(study: Study, variant: str) -> str:
    """The colour of `variant`: its place among the study's variants (first-seen order)."""
    names = list(dict.fromkeys(j.tags.get("csx.variant", j.name) for j in study.jobs))
    index = names.index(variant) if variant in names else len(names)
    return VARIANT_COLOURS[index % len(VARIANT_COLOURS)]


def run_identity(job: Job) -> tuple[str, dict[str, str]]:
    """MLflow run name and tags of a job: a study's variant by its name (and seed), any other
    job by its job name."""
    tags = {"csx.job_id": str(job.id)}
    if job.study is None:
        return job.name, {**tags, "csx.variant": job.name}
    variant = job.tags.get("csx.variant", job.name)
    seed = job.tags.get("csx.seed")
    tags.update({"csx.variant": variant, "csx.study_id": str(job.study_id), "csx.role": "variant",
                 "mlflow.runColor": variant_colour(job.study, variant)})
    return (variant if seed is None else f"{variant} seed {seed}"), tags


def study_status(study: Study) -> str:
    return "DONE" if all(JobStatus(j.status) in TERMINAL for j in study.jobs) else "RUNNING"


def build_report(study: Study) -> StudyReport:
    """The report's numbers, without its figure (service/study_reports.py draws that)."""
    rows = []
    for job in study.jobs:
        result = job.result or {}
        wall = result.get("job_wall_s")
        if wall is None and job.started_at and job.finished_at:
            wall = (job.finished_at - job.started_at).total_seconds()
        variant = job.tags.get("csx.variant", job.name)
        seed = job.tags.get("csx.seed")
        rows.append(StudyReportRow(
            job_id=job.id, variant=variant, status=job.status,
            final_eval_perplexity=result.get("final_eval_perplexity"),
            best_eval_perplexity=result.get("best_eval_perplexity"),
            projected_speedup=result.get("speedup_vs_dense"), wall_time_s=wall,
            seed=int(seed) if seed is not None else None,
        ))
    complete = study_status(study) == "DONE"
    summaries, gaps = aggregate(rows)
    return StudyReport(study_id=study.id, complete=complete, rows=rows, variants=summaries,
                       gaps=gaps, full_size=full_size_report(study), png_base64=None)


def study_figures(study: Study, report: StudyReport) -> dict[str, Any]:
    """The study's matplotlib figures by file name, each only once it has data:
    study_perplexity.png (eval loss and perplexity per variant and seed, in the variants'
    run colours) and study_tradeoff.png (final perplexity against projected speed-up)."""
    from tracking.plots import curves_figure, tradeoff_figure

    curves, colours = {}, {}
    for job in study.jobs:
        history = (job.result or {}).get("eval_history") or []
        if not history:
            continue
        variant, seed = job.tags.get("csx.variant", job.name), job.tags.get("csx.seed")
        label = variant if seed is None else f"{variant} seed {seed}"
        for key in ("loss", "perplexity"):
            curves[f"{label} eval/{key}"] = [(h["step"], h[key]) for h in history]
            colours[f"{label} eval/{key}"] = variant_colour(study, variant)
    figures = {}
    if curves:
        figures["study_perplexity.png"] = curves_figure(
            curves, title=f"study {study.name}: evaluation", colours=colours)
    points = [(row.variant if row.seed is None else f"{row.variant} seed {row.seed}",
               row.projected_speedup, row.final_eval_perplexity, variant_colour(study, row.variant))
              for row in report.rows
              if row.projected_speedup is not None and row.final_eval_perplexity is not None]
    if points:
        figures["study_tradeoff.png"] = tradeoff_figure(points, title=f"study {study.name}")
    return figures
