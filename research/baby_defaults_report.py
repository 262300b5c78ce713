"""The baby-GPT study's defaults (issue 34, item 3) decided by a one-knob sweep, on docs/results.md.

Reads research/results/study_results_baby_gpt_defaults.json (`research/study_results.py
--protocol baby --options ...`): runs that each change one key of a variant's sparsity section
(update interval, drop fraction, row balancing) from a base, the algorithm_options the study
file had when they ran (each run's `base`). Each is compared, seed by seed, with the base's own
run of that variant at the same level and width: the study's (study_results_baby_gpt.json)
while the file still has that base, else the sweep's runs that change nothing (kept from the
study when it moved on). The gap is judged against the seed noise of those base runs: a value
replaces the default only when it is better by more than the noise.
"""

from __future__ import annotations

import json
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


def study_options() -> dict[str, Any]:
    """examples/study_baby_gpt.yaml's algorithm_options: what the study runs now."""
    return yaml.safe_load(STUDY.read_text(encoding="utf-8")).get("algorithm_options") or {}


def section(algorithm: str, level: float, max_steps: int,
            options: dict[str, Any]) -> dict[str, Any]:
    """The sparsity section a study with these algorithm_options gives `algorithm`: the
    service's derived one with the options on top (as service.studies.variants builds it)."""
    from service.studies import variant_sparsity

    return {**variant_sparsity(algorithm, level, max_steps), **options.get(algorithm, {})}


def knob(run: dict[str, Any]) -> tuple[str, str | None, Any, Any]:
    """(algorithm, swept key, its value in the run, the base's value) of a sweep run: the one
    leaf its options change against the sections it ran from (`base`, None: the base has no
    such key). A run that changes nothing is the base's own (key None)."""
    [(algorithm, override)] = run["options"].items()
    default = _leaves(section(algorithm, run["level"], run["max_steps"], run["base"]))
    changed = {k: v for k, v in _leaves(override).items() if default.get(k) != v}
    if len(changed) > 1:
        raise ValueError(f"options {run['options']!r}: a sweep run changes one key of its "
                         f"base section, not {sorted(changed)}")
    if not changed:
        return algorithm, None, None, None
    [(key, value)] = changed.items()
    return algorithm, key, value, default.get(key)


def verdict(gap: float, noise: float | None) -> str:
    """Against the default: better (negative gap) or worse by more than the noise, or within."""
    if noise is None:
        return "no noise estimate"
    if abs(gap) <= noise:
        return "within noise"
    return f"{'better' if gap < 0 else 'worse'} by {abs(gap):.3f}, beyond noise"


def _base_text(base: dict[str, Any]) -> str:
    """A base's algorithm_options, one entry per distinct section override."""
    by_options: dict[str, list[str]] = defaultdict(list)
    for algorithm, options in base.items():
        by_options[json.dumps(options)].append(algorithm)
    return "; ".join(f"{', '.join(names)}: `{options}`" for options, names in by_options.items())


def reproduction_line(sweep: dict[str, Any], study: dict[str, Any],
                      current: dict[str, Any]) -> list[str]:
    """The sweep's runs of exactly the sections the study runs now, against the study's own
    runs of them: the same seed, section and code give the same loss (the loop is deterministic),
    so a difference says the code changed between the two."""
    differences: dict[str, list[float]] = defaultdict(list)
    for run in sweep["runs"]:
        [algorithm] = run["options"]
        ran = {**section(algorithm, run["level"], run["max_steps"], run["base"]),
               **run["options"][algorithm]}
        if ran != section(algorithm, run["level"], run["max_steps"], current):
            continue
        again = _losses(study["runs"], algorithm, run["level"], BASE_WIDTH).get(run["seed"])
        if again is not None:
            differences[algorithm].append(abs(again - math.log(run["final_ppl"])))
    if not differences:
        return []
    same = [a for a, d in differences.items() if max(d) == 0.0]
    moved = {a: max(d) for a, d in differences.items() if max(d) > 0.0}
    text = (f"Reproduction: {sum(map(len, differences.values()))} of the sweep's runs have "
            "exactly the sections the study runs now, and the study reran them (same seeds). ")
    if same:
        text += f"{', '.join(same)}: the same final loss, bit for bit. "
    if moved:
        text += ("; ".join(f"{a}: up to {d:.1g} apart" for a, d in moved.items())
                 + ": layers near the CSR-vs-dense crossover (GraNet's density passes it) "
                 "switched kernels at different steps in the two runs, which measured the "
                 "crossover each in its own process before it was measured once per machine "
                 "(simulator.crossover.machine_calibration), and CSR and dense round "
                 "differently; far below the seed noise.")
    return [text.strip(), ""]


def base_lines(runs: list[dict[str, Any]], base: dict[str, Any], study: dict[str, Any],
               current: dict[str, Any]) -> list[str]:
    """The table of every value swept around one base, and the decision per knob."""
    rows: dict[tuple[str, str, float, Any], dict[Any, dict[int, float]]] = defaultdict(dict)
    own: dict[tuple[str, float], dict[int, float]] = defaultdict(dict)  # the base's runs
    max_steps = {run["variant"]: run["max_steps"] for run in runs}
    for run in runs:
        algorithm, key, value, default = knob(run)
        loss = math.log(run["final_ppl"])  # the study's measure, nanoGPT's loss
        if key is None:
            own[algorithm, run["level"]][run["seed"]] = loss
        else:
            rows[algorithm, key, run["level"], default].setdefault(value, {})[run["seed"]] = loss
    is_study = base == current
    lines = [f"Around {'the study’s sections' if is_study else 'earlier sections'}: "
             f"{_base_text(base)}" + ("" if is_study else
                                      " (the base runs below are the study's as it ran then)."),
             "", "| variant, level | knob | value | final val loss | ppl | seeds | gap to base | "
             "noise (sd) | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    decisions = []
    # the study's variant order, then level and knob
    for (algorithm, key, level, default), values in sorted(
            rows.items(), key=lambda row: (VARIANTS.index(row[0][0]), -row[0][2], row[0][1])):
        base_losses = (_losses(study["runs"], algorithm, level, BASE_WIDTH) if is_study
                       else own[algorithm, level])
        base_sd = statistics.stdev(base_losses.values()) if len(base_losses) > 1 else None
        # how far one seed's gap strays from its mean: a single-seed value is judged by it too
        gap_sds = [statistics.stdev(diffs) for by_seed in values.values()
                   if len(diffs := paired_gap(base_losses, by_seed)[0]) > 1]
        name, where = KNOB_NAMES.get(key, key), f"{algorithm}, {level:.0%}"
        now = _leaves(section(algorithm, level, max_steps[algorithm], current)).get(key)
        better = []
        # the base in its place among the swept values (off first)
        for value in sorted([*values, default], key=lambda v: (v is not None, v)):
            mark = " (the study's)" if value == now else ""
            if value == default:
                kept = bool(base_losses)  # a base whose runs were not kept has no numbers
                lines.append(f"| {where} | {name} | {_shown(value)} (base){mark} | "
                             f"{fmt(list(base_losses.values())) if kept else '—'} | "
                             f"{_ppl(base_losses) if kept else '—'} | "
                             f"{len(base_losses)} | — | "
                             f"{'—' if base_sd is None else f'{base_sd:.3f}'} | |")
                continue
            by_seed = values[value]
            diffs, gap_text = paired_gap(base_losses, by_seed)
            # the largest seed sd: the base's, this knob's paired gaps', the swept value's
            sds = [sd for sd in (base_sd, *gap_sds) if sd is not None]
            if len(by_seed) > 1:
                sds.append(statistics.stdev(by_seed.values()))
            noise = max(sds) if sds else None
            judged = verdict(statistics.fmean(diffs), noise) if diffs else "no common seed"
            if judged.startswith("better"):
                better.append((statistics.fmean(diffs), value, noise, len(diffs)))
            lines.append(f"| {where} | {name} | {_shown(value)}{mark} | "
                         f"{fmt(list(by_seed.values()))} | {_ppl(by_seed)} | {len(by_seed)} | "
                         f"{gap_text} | {'—' if noise is None else f'{noise:.3f}'} | {judged} |")
        if better:
            gap, value, noise, seeds = min(better)
            decisions.append(f"- {name} ({where}): **change** to {_shown(value)}: better by "
                             f"{-gap:.3f} beyond noise ({noise:.3f}), "
                             f"{seeds} seed{'s' if seeds > 1 else ''}"
                             + ("; the study runs it now." if value == now else
                                f"; the study runs {_shown(now)}: examples/study_baby_gpt.yaml "
                                "says why."))
        else:
            decisions.append(f"- {name} ({where}): **keep** {_shown(default)}: no value is "
                             "better beyond noise"
                             + ("." if default == now else f"; the study runs {_shown(now)} "
                                "now, on the evidence of another variant or level."))
    return [*lines, "", "What the evidence says for each knob (examples/study_baby_gpt.yaml "
            "cites it):", "", *decisions, ""]


def defaults_section(sweep: dict[str, Any], study: dict[str, Any]) -> list[str]:
    """Every sweep, grouped by the sections it ran from, against its base runs."""
    current = study_options()
    by_base: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in sweep["runs"]:
        by_base[json.dumps(run["base"], sort_keys=True)].append(run)
    lines = [
        TITLE, "",
        "Each default of the sparse variants' sections (`examples/study_baby_gpt.yaml`) against "
        "the values either side of it, one key changed at a time from a base (the sections the "
        "study ran when the sweep ran), everything else as the study above. A swept value's gap "
        "is its final validation loss minus the base's, seed by seed (same data order), "
        "averaged over the seeds it ran; the noise is the seed sd of the base's own runs, or "
        "where larger the sd of the swept value's runs, or of the paired gaps of any value of "
        "the same knob that ran more than one seed (a single seed's gap strays by that much: "
        "the base's own sd understates it). A value beats the base only when it is better by "
        "more than that noise. When a value won, the study moved to it and reran: the sweep "
        "keeps the old base's own runs, so its gaps stay measured against what they ran from.",
        "",
        "One point of the sweep: `python research/study_results.py --protocol baby --seeds 0 "
        "--levels 0.9 --options '{\"rigl\": {\"balance_out_groups\": 32}}'` (repeat "
        "`--options` for more). Raw numbers, and the commands that made them, in "
        "`research/results/study_results_baby_gpt_defaults.json`: "
        f"{len(sweep['runs'])} runs, {sweep['total_wall_s'] / 60:.0f} min of wall time on 2 "
        "cores shared with other work.", ""]
    for base_json, runs in by_base.items():
        lines += base_lines(runs, json.loads(base_json), study, current)
    return [*lines, *reproduction_line(sweep, study, current)]


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
