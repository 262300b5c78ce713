"""The reference study over several seeds, plus Sparse-Wide RigL: writes docs/results.md.

Runs every variant of examples/study.yaml (the same sparsity sections the service derives),
and its RigL with `grow_score_scaling: sinkhorn` (docs/results.md, "Why RigL trailed Static"),
for each seed, in-process with `training.loop.train` (one torch thread, two runs at a time on
a 2-core machine), collecting per-step metrics through a tracker-shaped recorder; projects
the final masks onto 1, 2, 4 and 16 CS-2 systems with the simulator's cost model; renders
the tables and PNGs. Raw numbers go to research/results/study_results.json.

`--protocol blog` runs examples/study_blog.yaml instead (the Cerebras sparsity blog's protocol:
sparse runs at half the batch for twice the steps, drop fraction 0.5, rarer updates), each
variant's spec exactly as the service builds it, into research/results/study_results_blog.json;
docs/results.md then compares the two protocols (research/blog_report.py).

`--protocol baby` runs examples/study_baby_gpt.yaml (nanoGPT's CPU "baby GPT" shape, issue 34) at
each level of `--levels` and each model width of `--widths` (depth, heads and recipe fixed; the
FFN stays 4 x the width), into research/results/study_results_baby_gpt.json; dense runs once per
width and seed (it has no level). Tasks go seed by seed, so a stopped run leaves whole seeds.
A rerun skips the (variant, seed, level, width) runs the file already holds, so a stopped sweep
resumes where it stopped (research/baby_report.py renders it first on docs/results.md).
With `--options`, repeated, each a JSON object of `algorithm_options` overrides, it sweeps the
study's defaults one knob at a time instead, running only the algorithms each names, into
research/results/study_results_baby_gpt_defaults.json (research/baby_defaults_report.py).

Results are written after every finished run, so an interrupted run still renders
(`--render-only`).

    python research/study_results.py [--protocol reference|blog|baby] [--seeds 0,1,2] [--steps N]
                                     [--levels 0.8,0.9] [--widths 64,128,256] [--render-only]
                                     [--options '{"rigl": {"balance_out_groups": 32}}' ...]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, not installed

STUDY = ROOT / "examples" / "study.yaml"
BLOG_STUDY = ROOT / "examples" / "study_blog.yaml"
RESULTS = ROOT / "research" / "results" / "study_results.json"
BLOG_RESULTS = RESULTS.with_name("study_results_blog.json")
BABY_STUDY = ROOT / "examples" / "study_baby_gpt.yaml"
BABY_RESULTS = RESULTS.with_name("study_results_baby_gpt.json")
BABY_DEFAULTS_RESULTS = RESULTS.with_name("study_results_baby_gpt_defaults.json")  # --options
DENSE_CONTROL = "dense-half-batch"  # research/blog_report.py's control row
DOCS = ROOT / "docs"
PROJECTED_SYSTEMS = (1, 2, 4, 16)
SPARSE_WIDE_LEVELS = (0.5, 0.75)


class MetricRecorder:
    """Duck-types tracking.tracker.Tracker for train(): keeps metrics in memory."""

    def __init__(self) -> None:
        self.metrics: dict[str, list[tuple[int, float]]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            if name.startswith(("sparsity/", "mask/", "eval/")):
                self.metrics.setdefault(name, []).append((step, float(value)))

    def log_mask_update(self, step: int, masks: dict[str, Any]) -> None:
        del step, masks  # the mask/* metrics logged at the same step carry what we report

    def flush(self) -> None:
        """Nothing is buffered."""


def with_sinkhorn(sections: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A study's (variant, section) pairs plus the cause experiment's knob through the
    product's loop: the study's RigL growing by the Sinkhorn-scaled |gradient| (no row
    balancing: the scaling spreads rows and columns)."""
    from research.study_report import SINKHORN_VARIANT

    rigl = {k: v for k, v in dict(sections)["rigl"].items() if k != "balance_out_groups"}
    return [*sections, (SINKHORN_VARIANT, {**rigl, "grow_score_scaling": "sinkhorn"})]


def run_specs(steps: int | None, seeds: list[int]) -> list[dict[str, Any]]:
    """One task per (variant, seed), and the Sparse-Wide RigL runs on the first seed."""
    import yaml

    from service.schemas import StudyCreate
    from service.studies import variant_sparsity, variants

    body = yaml.safe_load(STUDY.read_text(encoding="utf-8"))
    if steps is not None:
        body["runconfig"] = {**body["runconfig"], "max_steps": steps,
                             "eval_frequency": max(1, steps // 10)}
    from service.api.body import nest_params

    study = StudyCreate.model_validate(nest_params(body, StudyCreate))
    base = study.params.model_dump(mode="json")
    max_steps = study.params.runconfig.max_steps
    tasks = []
    for seed in seeds:
        for name, section in with_sinkhorn(variants(study)):
            tasks.append({"variant": name, "seed": seed, "params": {
                **base, "sparsity": section, "runconfig": {**base["runconfig"], "seed": seed}}})
    for level in SPARSE_WIDE_LEVELS:
        tasks.append({"variant": f"sparse-wide rigl {level:.0%}", "seed": seeds[0], "params": {
            **base, "model": {**base["model"], "sparse_wide_sparsity": level},
            "sparsity": variant_sparsity("rigl", level, max_steps),
            "runconfig": {**base["runconfig"], "seed": seeds[0]}}})
    return tasks


def blog_specs(steps: int | None, seeds: list[int]) -> list[dict[str, Any]]:
    """One task per (variant, seed) of examples/study_blog.yaml, each spec as the service
    builds it (service.studies.variant_spec: the variant's batch and stretched steps). With
    `steps`, the dense base runs that many steps and each variant derives its own from its
    batch (same tokens)."""
    import yaml

    from service.api.body import nest_params
    from service.schemas import StudyCreate
    from service.studies import study_jobs, variant_spec

    body = yaml.safe_load(BLOG_STUDY.read_text(encoding="utf-8"))
    if steps is not None:
        body["runconfig"] = {**body["runconfig"], "max_steps": steps,
                             "eval_frequency": max(1, steps // 10)}
        body["variants"] = [{k: v for k, v in variant.items() if k != "max_steps"}
                            for variant in body["variants"]]
    study = StudyCreate.model_validate(nest_params(body, StudyCreate))
    jobs = study_jobs(study)
    # The control the protocol leaves out: dense at the sparse runs' batch and steps, to tell
    # what the smaller batch gives every model from what sparse training gives.
    sparse = next(job for job in jobs if job.sparsity is not None)
    jobs.append(sparse._replace(variant=DENSE_CONTROL, sparsity=None))
    return [{"variant": job.variant, "seed": seed, "params": variant_spec(
                study.params, job.sparsity, seed, batch_size=job.batch_size,
                max_steps=job.max_steps).model_dump(mode="json")}
            for seed in seeds for job in jobs]


def baby_specs(steps: int | None, seeds: list[int], levels: list[float],
               widths: list[int], options: dict[str, dict[str, Any]] | None = None,
               ) -> list[dict[str, Any]]:
    """One task per (width, level, seed, variant) of examples/study_baby_gpt.yaml, width-major,
    then level, then seed: the first width's first level finishes seed by seed before the next.
    Dense has no level: it runs at the first level only (`level` None).

    `options`, one point of a sweep of the study's defaults: keys that override the file's
    `algorithm_options` (e.g. `{"rigl": {"drop_fraction": ...}}`; `{"rigl": {}}`: the file's
    own section); only the algorithms it names run, each task carrying it as `options` and the
    file's `algorithm_options` it changed as `base` (both part of the run's key)."""
    import yaml

    from service.api.body import nest_params
    from service.schemas import StudyCreate
    from service.studies import variant_spec, variants

    body = yaml.safe_load(BABY_STUDY.read_text(encoding="utf-8"))
    if steps is not None:
        body["runconfig"] = {**body["runconfig"], "max_steps": steps,
                             "eval_frequency": max(1, steps // 8)}
    file_options = body.get("algorithm_options") or {}
    if options is not None:
        body["algorithms"] = list(options)
        body["algorithm_options"] = {**file_options, **{
            name: {**file_options.get(name, {}), **keys} for name, keys in options.items()}}
    tasks = []
    for width in widths:
        # nanoGPT's MLP is 4 x the width; heads and depth stay the file's.
        body["model"] = {**body["model"], "hidden_size": width, "filter_size": 4 * width}
        for level in levels:
            study = StudyCreate.model_validate(nest_params({**body, "sparsity": level}, StudyCreate))
            # a sweep of the defaults runs the algorithms it names; the study adds Sinkhorn RigL
            sections = variants(study) if options is not None else with_sinkhorn(variants(study))
            for seed in seeds:
                for name, section in sections:
                    if section is None and level != levels[0]:
                        continue  # dense is the same run at every level
                    spec = variant_spec(study.params, section, seed)
                    tasks.append({"variant": name, "seed": seed, "width": width,
                                  "level": None if section is None else level,
                                  **({} if options is None else {"options": options,
                                                                 "base": file_options}),
                                  "params": spec.model_dump(mode="json")})
    return tasks


def baby_key(run: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a run of the baby-GPT study (its results file holds each once); a
    defaults sweep's run also by the options it overrode and the sections it overrode them in."""
    key = run["variant"], run["seed"], run["level"], run["width"]
    if "options" not in run:
        return key
    return (*key, *(json.dumps(run[k], sort_keys=True) for k in ("options", "base")))


def merge_baby(extra: Path) -> None:
    """Fold a side sweep's results file (`--results`) into the baby study's: its runs the main
    file lacks, its commands, its wall time (summed: the two may have run side by side)."""
    main, side = (json.loads(path.read_text()) for path in (BABY_RESULTS, extra))
    done = {baby_key(run) for run in main["runs"]}
    runs = main["runs"] + [run for run in side["runs"] if baby_key(run) not in done]
    commands = main["commands"] + [c for c in side["commands"] if c not in main["commands"]]
    BABY_RESULTS.write_text(json.dumps({
        "command": " && ".join(commands), "commands": commands,
        "seeds": sorted({*main["seeds"], *side["seeds"]}),
        "total_wall_s": main["total_wall_s"] + side["total_wall_s"],
        "complete": main["complete"] and side["complete"],
        "runs": sorted(runs, key=lambda r: (r["seed"], r["variant"]))}, indent=1))


def run_task(task: dict[str, Any]) -> dict[str, Any]:
    import torch

    from training import checkpoint
    from training.build import build_sparse_model
    from models.config import ModelConfig
    from training.perf import project
    from csx_config import JobSpec
    from training.loop import train
    from training.plan import plan_job

    torch.set_num_threads(1)
    spec = JobSpec.model_validate(task["params"])
    plan = plan_job(spec)
    recorder = MetricRecorder()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as model_dir:
        summary = train(plan, model_dir=model_dir, mode="train_and_eval", tracker=recorder)
        state = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(model_dir))
    wall_s = time.perf_counter() - started
    model, _ = build_sparse_model(ModelConfig(**state["model_config"]), plan.sparsity, seed=plan.seed)
    model.load_state_dict(state["model"])
    tokens = spec.train_input.batch_size * spec.train_input.max_sequence_length
    projections = {str(n): project(model, seq_len=spec.train_input.max_sequence_length, global_tokens=tokens,
                                   num_csx=n).speedup_vs_dense for n in PROJECTED_SYSTEMS}
    extra = {k: task[k] for k in ("level", "width", "options", "base") if k in task}
    shown = {k: v for k, v in extra.items() if k != "base"}
    print(f"{task['variant']:<22} seed {task['seed']} {shown or ''}: final ppl "
          f"{summary['final_eval_perplexity']:.3f} in {wall_s:.0f} s", flush=True)
    return {"variant": task["variant"], "seed": task["seed"], **extra, "wall_s": wall_s,
            "final_ppl": summary["final_eval_perplexity"],
            "best_ppl": summary["best_eval_perplexity"],
            "eval_history": summary["eval_history"], "metrics": recorder.metrics,
            "sparsity": task["params"].get("sparsity"),  # the section it ran, for the reports
            "speedup": projections, "layer_density": summary.get("layer_density", {}),
            "params": sum(p.numel() for p in model.parameters()),
            "max_steps": spec.runconfig.max_steps, "batch_size": spec.train_input.batch_size}


def run_all(tasks: list[dict[str, Any]], processes: int, results: Path, command: str,
            seeds: list[int], kept: dict[str, Any] | None = None) -> None:
    """Runs `tasks` (two at a time by default) and rewrites `results` after each finished run,
    so that what finished survives an interruption. `kept`: an earlier results file whose runs
    (and wall time) stay beside the new ones."""
    started = time.perf_counter()
    runs: list[dict[str, Any]] = list((kept or {}).get("runs", []))
    commands = [*(kept or {}).get("commands", [kept["command"]] if kept else []), command]
    earlier_wall_s = (kept or {}).get("total_wall_s", 0.0)
    results.parent.mkdir(parents=True, exist_ok=True)
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        for done, run in enumerate(pool.imap_unordered(run_task, tasks, chunksize=1), 1):
            runs.append(run)
            results.write_text(json.dumps({
                "command": " && ".join(commands), "commands": commands, "seeds": seeds,
                "total_wall_s": earlier_wall_s + time.perf_counter() - started,
                "complete": done == len(tasks) and (kept or {}).get("complete", True),
                "runs": sorted(runs, key=lambda r: (r["seed"], r["variant"]))}, indent=1))


def algorithm_options(text: str) -> dict[str, dict[str, Any]]:
    """`--options`' value: a JSON object of algorithm -> keys of its sparsity section."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not (isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values())):
        raise argparse.ArgumentTypeError(
            f"expected an object of algorithm -> object of section keys, got {text}")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", choices=("reference", "blog", "baby"), default="reference",
                        help="examples/study.yaml (reference), examples/study_blog.yaml (blog) "
                             "or examples/study_baby_gpt.yaml (baby)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=None, help="override runconfig.max_steps")
    parser.add_argument("--levels", default="0.8", help="baby: comma-separated sparsities")
    parser.add_argument("--widths", default="128", help="baby: comma-separated hidden sizes")
    parser.add_argument("--results", type=Path, default=None,
                        help="write the runs here instead of the protocol's results file (a "
                             "second sweep beside a running one; merge with --merge)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--variants", default=None,
                        help="comma-separated: run only these; the results file keeps its "
                             "runs of the other variants")
    parser.add_argument("--merge", type=Path, default=None,
                        help="baby: fold this --results file into the study's, then render")
    parser.add_argument("--options", type=algorithm_options, action="append", default=None,
                        help="baby: a JSON object of algorithm_options overrides, e.g. "
                             "'{\"rigl\": {\"balance_out_groups\": 32}}'; repeat for a "
                             "one-knob sweep (only the named algorithms run, into "
                             "research/results/study_results_baby_gpt_defaults.json)")
    parser.add_argument("--render-only", action="store_true", help="re-render the results JSON")
    args = parser.parse_args()
    if args.merge is not None:
        merge_baby(args.merge)
    elif not args.render_only:
        seeds = [int(s) for s in args.seeds.split(",")]
        results = args.results or {
            "blog": BLOG_RESULTS,
            "baby": BABY_RESULTS if args.options is None else BABY_DEFAULTS_RESULTS,
        }.get(args.protocol, RESULTS)
        kept = None
        if args.protocol == "baby":
            tasks = [task for options in args.options or [None] for task in baby_specs(
                args.steps, seeds, [float(v) for v in args.levels.split(",")],
                [int(w) for w in args.widths.split(",")], options)]
            done = set()
            if BABY_RESULTS.exists() and results != BABY_RESULTS:  # a side sweep skips those too
                done = {baby_key(run) for run in json.loads(BABY_RESULTS.read_text())["runs"]}
            if results.exists():
                kept = json.loads(results.read_text())
                done |= {baby_key(run) for run in kept["runs"]}
            tasks = [t for t in tasks if baby_key(t) not in done]
            if kept is not None:
                seeds = sorted({*kept["seeds"], *seeds})
                kept["complete"] = True  # this run finishes what the stopped one left
        elif args.protocol == "blog":
            tasks = blog_specs(args.steps, seeds)
        else:
            tasks = run_specs(args.steps, seeds)
        if args.variants is not None:
            only = set(args.variants.split(","))
            tasks = [t for t in tasks if t["variant"] in only]
            if results.exists() and args.protocol != "baby":  # baby keeps and resumes instead
                kept = json.loads(results.read_text())
                kept["runs"] = [r for r in kept["runs"] if r["variant"] not in only]
        command = "python research/study_results.py " + shlex.join(sys.argv[1:])  # JSON quoted
        run_all(tasks, args.processes, results, command.strip(), seeds, kept)
    from research.blog_report import insert_blog_section
    from research.study_report import render

    cause = RESULTS.with_name("rigl_cause.json")
    reference = json.loads(RESULTS.read_text())
    render(reference, DOCS, json.loads(cause.read_text()) if cause.exists() else None)
    from research.gpu_report import GPU_RESULTS, insert_gpu_section  # make gpu-check's figures

    insert_gpu_section(DOCS / "results.md", json.loads(GPU_RESULTS.read_text()) if GPU_RESULTS.exists() else None)
    if BLOG_RESULTS.exists():
        insert_blog_section(DOCS / "results.md", json.loads(BLOG_RESULTS.read_text()), reference)
    if BABY_RESULTS.exists():  # inserted last, so it leads the page
        from research.baby_report import insert_baby_section

        baby = json.loads(BABY_RESULTS.read_text())
        if BABY_DEFAULTS_RESULTS.exists():  # right after the study it compares with
            from research.baby_defaults_report import insert_defaults_section

            insert_defaults_section(DOCS / "results.md",
                                    json.loads(BABY_DEFAULTS_RESULTS.read_text()), baby)
        insert_baby_section(DOCS / "results.md", baby, DOCS)
    print(f"wrote {DOCS / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
