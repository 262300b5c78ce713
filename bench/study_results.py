"""The reference study over several seeds, plus Sparse-Wide RigL: writes docs/results.md.

Runs every variant of examples/study.yaml (the same sparsity sections the service derives),
and its RigL with `grow_score_scaling: sinkhorn` (docs/results.md, "Why RigL trailed Static"),
for each seed, in-process with `workers.train.train` (one torch thread, two runs at a time on
a 2-core machine), collecting per-step metrics through a tracker-shaped recorder; projects
the final masks onto 1, 2, 4 and 16 CS-2 systems with the simulator's cost model; renders
the tables and PNGs. Raw numbers go to bench/results/study_results.json.

    python bench/study_results.py [--seeds 0,1,2] [--steps N] [--render-only]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, not installed

STUDY = ROOT / "examples" / "study.yaml"
RESULTS = ROOT / "bench" / "results" / "study_results.json"
DOCS = ROOT / "docs"
PROJECTED_SYSTEMS = (1, 2, 4, 16)
SPARSE_WIDE_LEVELS = (0.5, 0.75)


class MetricRecorder:
    """Duck-types workers.tracking.Tracker for train(): keeps metrics in memory."""

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


def run_specs(steps: int | None, seeds: list[int]) -> list[dict[str, Any]]:
    """One task per (variant, seed), and the Sparse-Wide RigL runs on the first seed."""
    import yaml

    from bench.study_report import SINKHORN_VARIANT
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
    sections = dict(variants(study))
    # The cause experiment's knob through the product's loop: the study's RigL growing by the
    # Sinkhorn-scaled |gradient| (no row balancing: the scaling spreads rows and columns).
    sinkhorn = {k: v for k, v in sections["rigl"].items() if k != "balance_out_groups"}
    sections[SINKHORN_VARIANT] = {**sinkhorn, "grow_score_scaling": "sinkhorn"}
    for seed in seeds:
        for name, section in sections.items():
            tasks.append({"variant": name, "seed": seed, "params": {
                **base, "sparsity": section, "runconfig": {**base["runconfig"], "seed": seed}}})
    for level in SPARSE_WIDE_LEVELS:
        tasks.append({"variant": f"sparse-wide rigl {level:.0%}", "seed": seeds[0], "params": {
            **base, "model": {**base["model"], "sparse_wide_sparsity": level},
            "sparsity": variant_sparsity("rigl", level, max_steps),
            "runconfig": {**base["runconfig"], "seed": seeds[0]}}})
    return tasks


def run_task(task: dict[str, Any]) -> dict[str, Any]:
    import torch

    from workers import checkpoint
    from workers.job import build_sparse_model
    from workers.model import ModelConfig
    from workers.perf import project
    from workers.spec import JobSpec
    from workers.train import train

    torch.set_num_threads(1)
    spec = JobSpec.model_validate(task["params"])
    recorder = MetricRecorder()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as model_dir:
        summary = train(spec, model_dir=model_dir, mode="train_and_eval", tracker=recorder)
        state = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(model_dir))
    wall_s = time.perf_counter() - started
    model, _ = build_sparse_model(spec, ModelConfig(**state["model_config"]))
    model.load_state_dict(state["model"])
    tokens = spec.train_input.batch_size * spec.train_input.max_sequence_length
    projections = {str(n): project(model, seq_len=spec.train_input.max_sequence_length, global_tokens=tokens,
                                   num_csx=n).speedup_vs_dense for n in PROJECTED_SYSTEMS}
    print(f"{task['variant']:<22} seed {task['seed']}: final ppl "
          f"{summary['final_eval_perplexity']:.3f} in {wall_s:.0f} s", flush=True)
    return {"variant": task["variant"], "seed": task["seed"], "wall_s": wall_s,
            "final_ppl": summary["final_eval_perplexity"],
            "best_ppl": summary["best_eval_perplexity"],
            "eval_history": summary["eval_history"], "metrics": recorder.metrics,
            "speedup": projections, "layer_density": summary.get("layer_density", {}),
            "params": sum(p.numel() for p in model.parameters()),
            "max_steps": spec.runconfig.max_steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=None, help="override runconfig.max_steps")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--render-only", action="store_true", help=f"re-render {RESULTS.name}")
    args = parser.parse_args()
    if not args.render_only:
        seeds = [int(s) for s in args.seeds.split(",")]
        tasks = run_specs(args.steps, seeds)
        started = time.perf_counter()
        with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
            runs = pool.map(run_task, tasks, chunksize=1)
        command = "python bench/study_results.py " + " ".join(sys.argv[1:])
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({"command": command.strip(), "seeds": seeds,
                                       "total_wall_s": time.perf_counter() - started,
                                       "runs": runs}, indent=1))
    from bench.study_report import render

    cause = RESULTS.with_name("rigl_cause.json")
    render(json.loads(RESULTS.read_text()), DOCS,
           json.loads(cause.read_text()) if cause.exists() else None)
    print(f"wrote {DOCS / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
