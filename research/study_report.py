"""Render research/results/study_results.json into docs/results.md and its PNGs."""

from __future__ import annotations

import platform
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from service.schemas import StudyReportRow
from service.studies import aggregate
from tracking.plots import plain_tick_labels

STUDY_VARIANTS = ("dense", "static", "set", "rigl", "granet")
SINKHORN_VARIANT = "rigl-sinkhorn"  # research/study_results.py's run of the cause knob


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def fmt(values: list[float], spec: str = ".3f") -> str:
    mean, sd = mean_sd(values)
    return f"{mean:{spec}} ± {sd:{spec}}" if len(values) > 1 else f"{mean:{spec}}"


def last_value(run: dict[str, Any], name: str) -> float | None:
    points = run["metrics"].get(name)
    return points[-1][1] if points else None


def render(data: dict[str, Any], docs: Path, cause: dict[str, Any] | None = None) -> None:
    """docs/results.md: with `cause` (research/results/rigl_cause.json) first the cause table, the
    chosen defaults and the study under them (research/cause_report.py), then `make results`."""
    images = docs / "images"
    images.mkdir(parents=True, exist_ok=True)
    by_variant: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in data["runs"]:
        by_variant[run["variant"]].append(run)
    study = [v for v in STUDY_VARIANTS if v in by_variant]
    _curves_png(by_variant, study, images / "perplexity_curves.png")
    _layer_sparsity_png(by_variant, images / "layer_sparsity_granet_vs_rigl.png")
    first = by_variant["dense"][0]
    lines = ["# Results: the reference study over seeds", ""]
    if cause is not None:
        from research.cause_report import cause_section

        lines += [*cause_section(cause, data["runs"]), ""]
    lines += [
        "## `make results`: the study through the service's training loop",
        "",
        "Regenerate this section (numbers, tables, images) with",
        "",
        "```bash",
        "make results     # = .venv/bin/python research/study_results.py --seeds 0,1,2",
        "```",
        "",
        f"Last run: `{data['command']}` on {platform.machine()} Linux, "
        f"{_cpu_count()} CPU cores, in {data['total_wall_s'] / 60:.1f} min (two runs at a time, "
        "one torch thread each). Raw numbers: `research/results/study_results.json`.",
        "",
        f"What ran: `examples/study.yaml` — the `tiny` Llama ({first['params']:,} parameters, "
        f"byte tokenizer), `builtin:shakespeare`, {first['max_steps']} steps of 16 × 128 tokens, "
        f"seeds {', '.join(map(str, data['seeds']))}; each variant's `sparsity:` section is the "
        "one the service derives for the study (`service/studies.py`). Each run trains in one "
        "process on the whole global batch: `num_csx: 2` splits that same batch over two "
        "replicas and averages their gradients, which is the same update up to float rounding, "
        "so the seeds were run without Ray to fit the machine.",
        "",
        "### Validation perplexity (mean ± sd over seeds)",
        "",
        "| variant | final ppl | best ppl | seeds | final ppl per seed |",
        "|---|---|---|---|---|",
    ]
    for name in study:
        runs = by_variant[name]
        per_seed = ", ".join(f"{r['final_ppl']:.3f}" for r in sorted(runs, key=lambda r: r["seed"]))
        lines.append(f"| {name} | {fmt([r['final_ppl'] for r in runs])} | "
                     f"{fmt([r['best_ppl'] for r in runs])} | {len(runs)} | {per_seed} |")
    lines += ["", "![perplexity curves](images/perplexity_curves.png)", "",
              "### Against the published orderings", "",
              *_ordering_lines(by_variant, study), "",
              *_sinkhorn_lines(by_variant),
              "### Per-layer sparsity over time: GraNet vs RigL (seed "
              f"{data['seeds'][0]})", "",
              "![per-layer sparsity](images/layer_sparsity_granet_vs_rigl.png)", "",
              "RigL keeps every layer at its uniform 80% target from step 0; GraNet starts at 50% "
              "and prunes globally (by magnitude across layers) on the cubic schedule, so layers "
              "end at different sparsities with the same 80% overall.", "",
              "### Mask churn and ITOP rate", "",
              "Churn: fraction of active positions that changed at an update, averaged over the "
              "updates of a run. ITOP rate: share of all weights that were ever active "
              "(in-time over-parameterisation), at the end of the run.", "",
              "| variant | mask updates | mean churn | final ITOP rate |", "|---|---|---|---|"]
    for name in study:
        runs = by_variant[name]
        churn = [statistics.fmean(v for _, v in r["metrics"]["mask/churn"])
                 for r in runs if r["metrics"].get("mask/churn")]
        itop = [last_value(r, "mask/itop_rate") for r in runs if r["metrics"].get("mask/itop_rate")]
        updates = len(runs[0]["metrics"].get("mask/churn", []))
        lines.append(f"| {name} | {updates} | {fmt(churn, '.4f') if churn else '— (fixed mask)'} "
                     f"| {fmt(itop, '.3f') if itop else '— (fixed mask)'} |")
    lines += ["", "### Projected CS-2 speed-up over dense", "", *_speedup_lines(by_variant, study),
              "", *_sparse_wide_lines(by_variant), ""]
    (docs / "results.md").write_text("\n".join(lines), encoding="utf-8")


def insert_after_title(results_md: Path, section: list[str]) -> None:
    """Put `section` right after the page title (before the first `## ` section)."""
    text = results_md.read_text(encoding="utf-8")
    head, sep, rest = text.partition("\n## ")
    body = "\n".join(section)
    results_md.write_text(f"{head}\n{body}\n{sep.lstrip(chr(10))}{rest}" if sep
                          else f"{text}\n{body}\n", encoding="utf-8")


def _cpu_count() -> int:
    import os

    return os.cpu_count() or 1


def comparison_lines(runs: dict[str, list[float]]) -> list[str]:
    """The ordering of `runs` (variant -> final perplexity per seed) and each pair's gap against
    seed noise, by the same `service.studies.aggregate` a study's report uses."""
    rows = [StudyReportRow(job_id=0, variant=name, status="SUCCEEDED", final_eval_perplexity=p,
                           best_eval_perplexity=p, projected_speedup=None, wall_time_s=None,
                           seed=seed)
            for name, values in runs.items() for seed, p in enumerate(values)]
    summaries, gaps = aggregate(rows)
    ranked = sorted(summaries, key=lambda s: s.final_eval_perplexity_mean)
    lines = ["Order, best first (mean final perplexity): " + " < ".join(
        f"{s.variant} ({s.final_eval_perplexity_mean:.3f})" for s in ranked) + ".", "",
        "Cerebras reports dense < RigL < SET < Static at 80% and GraNet 50→80% below RigL 80%. "
        "Each pair (a gap is real when it exceeds the larger of the two seed-to-seed standard "
        "deviations; `service/studies.py:aggregate`, the same check a study's report makes):", ""]
    for gap in sorted(gaps, key=lambda g: (g.published is None, -g.gap)):
        verdict = f"**{gap.published}** with the published order, " if gap.published else ""
        noise = "" if gap.noise is None else f", sd {gap.noise:.3f}"
        lines.append(f"- {gap.better} < {gap.worse}: {verdict}gap {gap.gap:+.3f}{noise}: "
                     f"{gap.verdict}")
    return lines


def _ordering_lines(by_variant: dict[str, list[dict]], study: list[str]) -> list[str]:
    return comparison_lines({name: [r["final_ppl"] for r in sorted(by_variant[name],
                                                                  key=lambda r: r["seed"])]
                             for name in study})


def _sinkhorn_lines(by_variant: dict[str, list[dict]]) -> list[str]:
    """The study's RigL next to the same RigL growing by the Sinkhorn-scaled |gradient|."""
    if SINKHORN_VARIANT not in by_variant:
        return []
    compared = ("set", "static", "rigl", SINKHORN_VARIANT)
    lines = [f"### RigL without the pile-up: `{SINKHORN_VARIANT}`", "",
             "The study's RigL growing by the |gradient| rescaled to equal row and column sums "
             "(`grow_score_scaling: sinkhorn`, a knob of this library, not in the RigL paper or "
             "cstorch; no row balancing), same seeds, through the same loop. Not a study "
             "variant: the cause experiment of the first section, measured here.", "",
             "| variant | final ppl | per seed |", "|---|---|---|"]
    for name in compared:
        runs = sorted(by_variant[name], key=lambda r: r["seed"])
        lines.append(f"| {name} | {fmt([r['final_ppl'] for r in runs])} | "
                     + ", ".join(f"{r['final_ppl']:.3f}" for r in runs) + " |")
    lines.append("")
    ours = [r["final_ppl"] for r in by_variant[SINKHORN_VARIANT]]
    for name in ("set", "static", "rigl"):
        other = [r["final_ppl"] for r in by_variant[name]]
        gap = statistics.fmean(ours) - statistics.fmean(other)
        noise = max(mean_sd(ours)[1], mean_sd(other)[1])
        lines.append(f"- {SINKHORN_VARIANT} − {name}: {gap:+.3f} "
                     f"({'beyond' if abs(gap) > noise else 'within'} the seed sd {noise:.3f})")
    return [*lines, ""]


def _speedup_lines(by_variant: dict[str, list[dict]], study: list[str]) -> list[str]:
    systems = list(by_variant["dense"][0]["speedup"])
    header = "| variant | " + " | ".join(f"num_csx {n}" for n in systems) + " |"
    rule = "|---|" + "---|" * len(systems)
    lines = ["Cost model of `simulator/cost_model.py` (docs/design.md §3), from each run's final "
             "masks, for the trained model and one 16 × 128-token step:", "", header, rule]
    for name in study:
        runs = by_variant[name]
        lines.append(f"| {name} | " + " | ".join(
            f"{fmt([r['speedup'][n] for r in runs], '.4f')}×" for n in systems) + " |")
    lines += ["", "The tiny model is overhead-bound on a wafer: its step is microseconds of "
              "compute next to the fixed per-layer latency and the 1 ms sync, so sparsity "
              "cannot show (hence ≈ 1.00× for every variant).", ""]
    from research.cause_report import full_size_lines

    trained = {name: _final_densities(by_variant[name]) for name in study}
    return lines + full_size_lines(trained, "final masks, mean over seeds")


def _final_densities(runs: list[dict]) -> dict[str, float]:
    """Each sparse layer's final density, mean over the runs (from its sparsity/<layer>/actual)."""
    names = [m for m in runs[0]["metrics"] if m.startswith("sparsity/") and m.endswith("/actual")]
    return {m.removeprefix("sparsity/").removesuffix("/actual"):
            1.0 - statistics.fmean(last_value(r, m) for r in runs) for m in names}


def _sparse_wide_lines(by_variant: dict[str, list[dict]]) -> list[str]:
    wide = sorted(v for v in by_variant if v.startswith("sparse-wide"))
    if not wide:
        return []
    dense = by_variant["dense"][0]
    lines = ["### Sparse-Wide (Sparse-IFT) RigL at equal FLOPs", "",
             "Sparse-Wide widens every block projection by k = 1/√(1 − s) so that each sparse "
             "layer has the dense layer's FLOPs; embeddings and the LM head stay dense "
             f"(seed {dense['seed']}, same steps and data).", "",
             "| variant | parameters (stored) | final ppl | best ppl |", "|---|---|---|---|",
             f"| dense baseline | {dense['params']:,} | {dense['final_ppl']:.3f} | "
             f"{dense['best_ppl']:.3f} |"]
    for name in wide:
        run = by_variant[name][0]
        lines.append(f"| {name} | {run['params']:,} | {run['final_ppl']:.3f} | "
                     f"{run['best_ppl']:.3f} |")
    noise = mean_sd([r["final_ppl"] for r in by_variant["dense"]])[1]
    verdicts = []
    for name in wide:
        gap = dense["final_ppl"] - by_variant[name][0]["final_ppl"]
        strength = "beyond" if abs(gap) > noise else "within"
        verdicts.append(f"{name} is {abs(gap):.3f} {'below' if gap > 0 else 'above'} it "
                        f"({strength} the dense seed-to-seed sd of {noise:.3f})")
    lines += ["", "Sparse-IFT reports Sparse-Wide beating its dense baseline at equal FLOPs. "
              f"Here {'; '.join(verdicts)}: one seed each, so only a gap beyond that sd counts. "
              "Both store more weights than the dense model (zeros included) and cost the same "
              "FLOPs only where the fabric skips the zeros."]
    return lines


def _curves_png(by_variant: dict[str, list[dict]], study: list[str], path: Path) -> None:
    figure = Figure(figsize=(7, 4.5), dpi=100)
    axes = figure.add_subplot()
    for name in study:
        histories = [r["eval_history"] for r in by_variant[name]]
        steps = [h["step"] for h in histories[0]]
        means = [statistics.fmean(h[i]["perplexity"] for h in histories)
                 for i in range(len(steps))]
        axes.plot(steps, means, marker="o", markersize=3, label=name)
    axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.set_ylabel("validation perplexity (mean over seeds)")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)


def _layer_sparsity_png(by_variant: dict[str, list[dict]], path: Path) -> None:
    figure = Figure(figsize=(11, 4), dpi=100)
    for axes, name in zip(figure.subplots(1, 2, sharey=True), ("rigl", "granet")):
        run = min(by_variant[name], key=lambda r: r["seed"])
        for metric, points in sorted(run["metrics"].items()):
            if metric.startswith("sparsity/") and metric.endswith("/actual"):
                layer = metric.removeprefix("sparsity/").removesuffix(".weight/actual")
                axes.plot(*zip(*points), label=layer, linewidth=1)
        axes.set_title(name)
        axes.set_xlabel("step")
        axes.grid(True, alpha=0.3)
        plain_tick_labels(axes)  # levels near 0.8 must read as 0.797, not 1e-3 + 0.79
    figure.axes[0].set_ylabel("layer sparsity")
    figure.axes[1].legend(fontsize=6, loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
