"""The baby-GPT study's defaults (issue 34, item 3) decided by a one-knob sweep, on docs/results.md.

Reads research/results/study_results_baby_gpt_defaults.json (`research/study_results.py
--protocol baby --options ...`): runs that each change one key of a variant's sparsity section
(update interval, drop fraction, row balancing). Each is compared, seed by seed, with the
study's own run of that variant at the same level and width (study_results_baby_gpt.json), and
the gap is judged against the seed noise of those default runs: a value replaces the default
only when it is better by more than the noise.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from research.baby_report import BASE_WIDTH, VARIANTS, _losses, paired_gap
from research.study_report import fmt, insert_after_title

STUDY = Path(__file__).resolve().parents[1] / "examples" / "study_baby_gpt.yaml"
TITLE = "## The baby-GPT study's defaults, one knob at a time"
# What each swept key of a sparsity section is, for the table (the key itself otherwise).
KNOB_NAMES = {"update.freq": "update interval ΔT (steps)",
              "drop_fraction.init": "drop fraction (initial, cosine-decayed)",
              "balance_out_groups": "row balancing (balance_out_groups)"}


def _leaves(section: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested section as dotted keys -> values."""
    leaves = {}
    for key, value in section.items():
        if isinstance(value, dict):
            leaves |= _leaves(value, f"{prefix}{key}.")
        else:
            leaves[f"{prefix}{key}"] = value
    return leaves


def default_section(algorithm: str, level: float, max_steps: int) -> dict[str, Any]:
    """The section examples/study_baby_gpt.yaml gives `algorithm`: the service's derived one
    with the file's algorithm_options on top (as service.studies.variants builds it)."""
    from service.studies import variant_sparsity

    options = yaml.safe_load(STUDY.read_text(encoding="utf-8")).get("algorithm_options") or {}
    return {**variant_sparsity(algorithm, level, max_steps), **options.get(algorithm, {})}


def knob(run: dict[str, Any]) -> tuple[str, str, Any, Any]:
    """(algorithm, swept key, its value in the run, the default's value) of a sweep run: the
    one leaf its options change against the file's section (None: the default has no such key)."""
    [(algorithm, override)] = run["options"].items()
    default = _leaves(default_section(algorithm, run["level"], run["max_steps"]))
    changed = {k: v for k, v in _leaves(override).items() if default.get(k) != v}
    if len(changed) != 1:
        # the file's defaults moved since the sweep ran: the sweep reruns around the new ones
        raise ValueError(f"options {run['options']!r}: a sweep run changes one key of the "
                         f"file's current section, not {sorted(changed)}")
    [(key, value)] = changed.items()
    return algorithm, key, value, default.get(key)


def verdict(gap: float, noise: float | None) -> str:
    """Against the default: better (negative gap) or worse by more than the noise, or within."""
    if noise is None:
        return "no noise estimate"
    if abs(gap) <= noise:
        return "within noise"
    return f"{'better' if gap < 0 else 'worse'} by {abs(gap):.3f}, beyond noise"


def defaults_section(sweep: dict[str, Any], study: dict[str, Any]) -> list[str]:
    """The table of every swept value against the default, and the decision per knob."""
    rows: dict[tuple[str, str, float, Any], dict[Any, dict[int, float]]] = defaultdict(dict)
    for run in sweep["runs"]:
        algorithm, key, value, default = knob(run)
        rows[algorithm, key, run["level"], default].setdefault(value, {})[run["seed"]] = (
            math.log(run["final_ppl"]))  # the study's measure, nanoGPT's loss
    lines = [
        TITLE, "",
        "Each default of the sparse variants' sections (`examples/study_baby_gpt.yaml`) against "
        "the values either side of it, one key changed at a time, everything else as the "
        "study above. A swept value's gap is its final validation loss minus the default's, "
        "seed by seed (same data order), averaged over the seeds it ran; the noise is the seed "
        "sd of the default's own runs in the study, or where larger the sd of the swept value's "
        "runs, or of the paired gaps of any value of the same knob that ran more than one seed "
        "(a single seed's gap strays by that much: the default's own sd understates it). A "
        "value beats the default only when it is better by more than that noise.", "",
        "One point of the sweep: `python research/study_results.py --protocol baby --seeds 0 "
        "--levels 0.9 --options '{\"rigl\": {\"balance_out_groups\": 32}}'` (repeat "
        "`--options` for more). Raw numbers, and the commands that made them, in "
        "`research/results/study_results_baby_gpt_defaults.json`: "
        f"{len(sweep['runs'])} runs, {sweep['total_wall_s'] / 60:.0f} min of wall time on 2 "
        "cores shared with other work.", "",
        "| variant, level | knob | value | final val loss | ppl | seeds | gap to default | "
        "noise (sd) | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    decisions = []
    # the study's variant order, then level and knob
    for (algorithm, key, level, default), values in sorted(
            rows.items(), key=lambda row: (VARIANTS.index(row[0][0]), -row[0][2], row[0][1])):
        base = _losses(study["runs"], algorithm, level, BASE_WIDTH)
        base_sd = statistics.stdev(base.values()) if len(base) > 1 else None
        # how far one seed's gap strays from its mean: a single-seed value is judged by it too
        gap_sds = [statistics.stdev(diffs) for by_seed in values.values()
                   if len(diffs := paired_gap(base, by_seed)[0]) > 1]
        name, where = KNOB_NAMES.get(key, key), f"{algorithm}, {level:.0%}"
        better = []
        # the default in its place among the swept values (off first)
        for value in sorted([*values, default], key=lambda v: (v is not None, v)):
            if value == default:
                lines.append(f"| {where} | {name} | {_shown(value)} (default) | "
                             f"{fmt(list(base.values()))} | {_ppl(base)} | {len(base)} | — | "
                             f"{'—' if base_sd is None else f'{base_sd:.3f}'} | |")
                continue
            by_seed = values[value]
            diffs, gap_text = paired_gap(base, by_seed)
            # the largest seed sd: the default's, this knob's paired gaps', the swept value's
            sds = [sd for sd in (base_sd, *gap_sds) if sd is not None]
            if len(by_seed) > 1:
                sds.append(statistics.stdev(by_seed.values()))
            noise = max(sds) if sds else None
            judged = verdict(statistics.fmean(diffs), noise) if diffs else "no common seed"
            if judged.startswith("better"):
                better.append((statistics.fmean(diffs), value, noise, len(diffs)))
            lines.append(f"| {where} | {name} | {_shown(value)} | {fmt(list(by_seed.values()))} | "
                         f"{_ppl(by_seed)} | {len(by_seed)} | {gap_text} | "
                         f"{'—' if noise is None else f'{noise:.3f}'} | {judged} |")
        if better:
            gap, value, noise, seeds = min(better)
            decisions.append(f"- {name} ({where}): **change** to {_shown(value)}: better by "
                             f"{-gap:.3f} beyond noise ({noise:.3f}), "
                             f"{seeds} seed{'s' if seeds > 1 else ''}.")
        else:
            decisions.append(f"- {name} ({where}): **keep** {_shown(default)}: no value is "
                             "better beyond noise.")
    return [*lines, "", "What the evidence says for each default (examples/study_baby_gpt.yaml "
            "cites it):", "",
            *decisions, ""]


def _shown(value: Any) -> str:
    """A knob's value in the table: a key the default section lacks is off."""
    return "off" if value is None else str(value)


def _ppl(by_seed: dict[int, float]) -> str:
    """The mean perplexity of the runs whose final losses are `by_seed`."""
    return f"{statistics.fmean(math.exp(v) for v in by_seed.values()):.3f}"


def insert_defaults_section(results_md: Path, sweep: dict[str, Any],
                            study: dict[str, Any]) -> None:
    """Put the section right after the page title (the baby study's section goes in front of
    it afterwards, so the two read in that order)."""
    insert_after_title(results_md, defaults_section(sweep, study))
