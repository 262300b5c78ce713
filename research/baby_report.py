"""The study at nanoGPT's "baby GPT" shape (issue 34) as the first docs/results.md section.

Reads research/results/study_results_baby_gpt.json (`research/study_results.py --protocol baby`):
per sparsity level at the file's width, each variant's final validation loss (ln of the
perplexity, nanoGPT's number) over seeds, its paired gap to Static (same seed, same data order),
and a verdict on each published claim; then, where several widths ran, each sparse variant's gap
to dense and to Static against width, per level (docs/images/baby_gpt_width_gaps_<level>.png).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from research.blog_report import claim_verdict
from research.study_report import SINKHORN_VARIANT, fmt, insert_after_title
from tracking.plots import plain_tick_labels

VARIANTS = ("dense", "static", "set", "rigl", "granet", SINKHORN_VARIANT)
SPARSE = VARIANTS[1:]
# The published orderings the study checks (better first): the RigL paper and Cerebras' blog
# put SET and RigL ahead of Static, GraNet's paper (Liu et al. 2021) GraNet ahead of RigL.
CLAIMS = (("rigl", "static"), ("set", "static"), ("granet", "rigl"))
# Student's t, two-sided 5% critical values by degrees of freedom (any statistics table).
T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
NANOGPT_DENSE_LOSS = 1.88  # nanoGPT's README, the CPU "baby GPT" run on tiny Shakespeare
BASE_WIDTH = 128  # the file's hidden_size: the level tables are at this width
TITLE = "## The reference study at nanoGPT's baby-GPT shape (4 layers × 128)"


def _loss(run: dict[str, Any]) -> float:
    return math.log(run["final_ppl"])


def _losses(runs: list[dict[str, Any]], variant: str, level: float | None,
            width: int) -> dict[int, float]:
    """seed -> final validation loss of `variant` (dense: any level) at `level` and `width`."""
    return {r["seed"]: _loss(r) for r in runs if r["variant"] == variant and r["width"] == width
            and (variant == "dense" or r["level"] == level)}


def update_text(runs: list[dict[str, Any]]) -> str:
    """The mask-update schedule the file's dynamic runs ran (each run records its section)."""
    schedules = {json.dumps(run["sparsity"]["update"], sort_keys=True) for run in runs
                 if (run.get("sparsity") or {}).get("update") and run["width"] == BASE_WIDTH}
    if len(schedules) != 1:
        return f"mask updates on mixed schedules ({', '.join(sorted(schedules)) or 'none recorded'})"
    update = json.loads(schedules.pop())
    return f"a mask update every {update['freq']} steps to step {update['stop']}"


def paired_gap(better: dict[int, float], worse: dict[int, float]) -> tuple[list[float], str]:
    """Per-seed differences worse − better over the seeds both ran, and their mean ± sd."""
    diffs = [worse[s] - better[s] for s in sorted(better.keys() & worse.keys())]
    if len(diffs) < 2:
        return diffs, f"{diffs[0]:+.3f}" if diffs else "—"
    return diffs, f"{statistics.fmean(diffs):+.3f} ± {statistics.stdev(diffs):.3f}"


def claim_line(better: str, worse: str, losses: dict[str, dict[int, float]]) -> str:
    """A claim's verdict: the unpaired rule the study's report uses (the gap against the larger
    seed sd, 2 runs a side at least) and, beside it, the paired gap over common seeds."""
    a, b = losses.get(better, {}), losses.get(worse, {})
    if not a or not b:
        return f"| {better} < {worse} | not run | — | — |"
    gap, noise, real = claim_verdict(list(a.values()), list(b.values()))
    diffs, paired = paired_gap(a, b)
    holds = "holds" if gap > 0 else "reversed"
    if min(len(a), len(b)) < 2:
        verdict = f"{holds}, 1 seed: no noise estimate"
    else:
        verdict = f"{holds}, {'beyond' if real else 'within'} seed noise (sd {noise:.3f})"
        if len(diffs) > 1:
            sd, mean, df = statistics.stdev(diffs), statistics.fmean(diffs), len(diffs) - 1
            verdict += f"; paired: {'beyond' if abs(mean) > sd else 'within'} its sd"
            if sd > 0:
                t = mean / (sd / math.sqrt(len(diffs)))
                significant = abs(t) > T_975.get(df, 1.96)
                verdict += f", t = {t:.1f} on {df} df (p {'<' if significant else '≥'} 0.05)"
    return f"| {better} < {worse} | {worse} − {better} {gap:+.3f} | {paired} | {verdict} |"


def level_lines(runs: list[dict[str, Any]], level: float) -> list[str]:
    losses = {v: _losses(runs, v, level, BASE_WIDTH) for v in VARIANTS}
    losses = {v: l for v, l in losses.items() if l}
    static = losses.get("static", {})
    dense = losses.get("dense", {})
    lines = [f"### {level:.0%} sparsity, final validation loss", "",
             "Paired gaps: the variant's loss minus Static's (or dense's) seed by seed, mean ± sd "
             "over the seeds both ran; below 0 the variant is better.", "",
             "| variant | loss, mean ± sd | seeds | per seed | paired gap to Static | "
             "paired gap to dense | wall time per run (s) |", "|---|---|---|---|---|---|---|"]
    for name, by_seed in losses.items():
        walls = [r["wall_s"] for r in runs if r["variant"] == name and r["width"] == BASE_WIDTH
                 and (name == "dense" or r["level"] == level)]
        to_static = paired_gap(static, by_seed)[1] if name not in ("static", "dense") else ""
        to_dense = paired_gap(dense, by_seed)[1] if name != "dense" else ""
        lines.append(f"| {name} | {fmt(list(by_seed.values()))} | {len(by_seed)} | "
                     f"{', '.join(f'{by_seed[s]:.3f}' for s in sorted(by_seed))} | {to_static} | "
                     f"{to_dense} | {statistics.fmean(walls):.0f} |")
    lines += ["", "A claim holds when its gap (worse − better) is positive; the verdict is the "
              "study's rule (beyond noise when the gap exceeds the larger of the two seed sds), "
              "with the paired gap's own mean against its sd beside it, and its paired t "
              "(mean / (sd / √seeds)) against Student's 5% two-sided critical value.", "",
              "| published claim | unpaired gap | paired gap, worse − better (mean ± sd) | "
              "verdict |",
              "|---|---|---|---|", *(claim_line(b, w, losses) for b, w in CLAIMS), ""]
    return lines


def width_png(runs: list[dict[str, Any]], level: float, widths: list[int], path: Path) -> None:
    """Each sparse variant's paired gap to dense and to Static (mean over the seeds both ran,
    bars: the sd of the per-seed gaps) by width."""
    figure = Figure(figsize=(10, 4), dpi=100)
    panels = figure.subplots(1, 2, sharex=True)
    for axes, reference in zip(panels, ("dense", "static")):
        for name in (v for v in SPARSE if v != reference):
            points = []
            for width in widths:
                diffs, _ = paired_gap(_losses(runs, reference, level, width),
                                      _losses(runs, name, level, width))
                if diffs:
                    spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
                    points.append((width, statistics.fmean(diffs), spread))
            if points:
                widths_run, gaps, spreads = zip(*points)
                # one colour per variant in both panels
                axes.errorbar(widths_run, gaps, yerr=spreads, marker="o", capsize=3, label=name,
                              color=f"C{SPARSE.index(name)}")
        axes.axhline(0.0, color="grey", linewidth=0.8)
        axes.set_xscale("log", base=2)
        axes.set_xticks(widths, [str(w) for w in widths])
        axes.set_xlabel("width (hidden_size; 4 layers, FFN 4 × width)")
        axes.set_ylabel(f"final val loss − {reference}'s")
        axes.set_title(f"gap to {reference} at {level:.0%} (below 0: better)")
        axes.grid(True, alpha=0.3)
        plain_tick_labels(axes)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path)


def width_png_name(level: float) -> str:
    return f"baby_gpt_width_gaps_{round(level * 100)}.png"


def width_lines(runs: list[dict[str, Any]], level: float, widths: list[int],
                images: Path) -> list[str]:
    width_png(runs, level, widths, images / width_png_name(level))
    header = " | ".join(f"{w}" for w in widths)
    lines = [f"### Width sweep at {level:.0%}: the gaps against model width", "",
             "Depth (4 layers), heads (4), block, batch and recipe fixed; FFN 4 × width. Each "
             "cell: final validation loss, mean over the seeds that ran (count in brackets). The "
             "plot's gaps are paired: the mean of the per-seed differences over the seeds both "
             "variants ran, with their sd as bars.", "",
             f"| variant | {header} |", "|---|" + "---|" * len(widths)]
    for name in VARIANTS:
        cells = []
        for width in widths:
            by_seed = _losses(runs, name, level, width)
            cells.append(f"{statistics.fmean(by_seed.values()):.3f} ({len(by_seed)})"
                         if by_seed else "—")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    params = {r["width"]: r["params"] for r in runs if r["variant"] == "dense"}
    lines += ["| parameters (dense) | " + " | ".join(f"{params[w]:,}" if w in params else "—"
                                                     for w in widths) + " |", "",
              f"![gaps to dense and Static against width at {level:.0%}]"
              f"(images/{width_png_name(level)})", ""]
    return lines


def baby_section(data: dict[str, Any], images: Path) -> list[str]:
    runs = data["runs"]
    dense = _losses(runs, "dense", None, BASE_WIDTH)
    levels = sorted({r["level"] for r in runs if r["level"] is not None and r["width"] == BASE_WIDTH})
    partial = "" if data.get("complete", True) else (
        f" **Partial:** the last run was stopped after {len(runs)} runs; each table gives the "
        "seeds each number has.")
    first = next(r for r in runs if r["width"] == BASE_WIDTH)
    lines = [
        TITLE, "",
        "The 2 × 64 study below puts RigL last; the published results (the RigL paper, "
        "Cerebras' blog) put it ahead of Static. This section runs the same five variants "
        "(and RigL with the 2 × 64 study's Sinkhorn knob) one step up in scale, at nanoGPT's "
        "CPU \"baby GPT\" configuration (`examples/study_baby_gpt.yaml`"
        ": a GPT-2 block, 4 layers, 4 heads, 128 wide, block 64, batch 12, "
        f"{first['max_steps']} steps, AdamW 1e-3 with β₂ 0.99, warm-up 100 then cosine to 1e-4, "
        "weight decay 0.1, clip 1.0, dropout 0), on `builtin:shakespeare` bytes. Sparse "
        "variants: uniform sparsity over the attention and FFN projections, "
        f"{update_text(runs)}, drop fraction 0.3 cosine-decayed, GraNet from 50%, no row "
        f"balancing; {SINKHORN_VARIANT} is RigL growing by the Sinkhorn-scaled |gradient| (the "
        "2 × 64 study's cause experiment, below). Numbers are final validation losses (ln of the perplexity, 20 batches), "
        "nanoGPT's measure.", "",
        f"Regenerate with `make results` (`research/study_results.py --protocol baby`); raw "
        f"numbers in `research/results/study_results_baby_gpt.json`, with the commands that "
        f"made them ({len(data.get('commands') or [data['command']])}, side sweeps merged with "
        "`--merge`): "
        f"{len(runs)} runs, {sum(r['wall_s'] for r in runs) / 3600:.1f} h of training summed "
        f"over the runs, two at a time on 2 CPU cores (some beside other work), one torch "
        f"thread each.{partial}", ""]
    if dense:
        values = list(dense.values())
        lines += [f"**Reproduction anchor:** dense reaches a validation loss of {fmt(values)} "
                  f"({len(values)} seed{'s' if len(values) > 1 else ''}); nanoGPT's README "
                  f"reports about {NANOGPT_DENSE_LOSS} for this configuration on its tiny-"
                  "Shakespeare file (65 characters, 90/10 split), a different cut of the same "
                  "plays than this corpus (Gutenberg texts, split by play), so the numbers "
                  "agree only as far as the corpora do.", ""]
    walls = [r["wall_s"] for r in runs if r["width"] == BASE_WIDTH]
    lines += [f"`make run` runs this study through the service at 80%, seed 0: a run at this "
              f"shape took {min(walls):.0f}–{max(walls):.0f} s of wall time here ({len(walls)} "
              "runs, one torch thread each, two at a time), so its five variants fit `make "
              "run`'s 10 minutes on 2 cores, install included. Its runs are this table's seed-0 "
              "runs (one thread each, as here), to the last bit where the fabric picks the same "
              "kernels (docs/semantics.md).", ""]
    for level in levels:
        lines += level_lines(runs, level)
    for level in sorted({r["level"] for r in runs if r["level"] is not None}):
        # the widths where some sparse variant ran at this level
        widths = sorted({r["width"] for r in runs if r["level"] == level})
        if len(widths) > 1:
            lines += width_lines(runs, level, widths, images)
    return lines


def insert_baby_section(results_md: Path, data: dict[str, Any], docs: Path) -> None:
    """Put the section right after the page title, ahead of every other section."""
    insert_after_title(results_md, baby_section(data, docs / "images"))
