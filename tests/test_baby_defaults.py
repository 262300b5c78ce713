"""The baby-GPT study's defaults sweep (issue 34, item 3): its tasks, its keys and its verdicts."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from research import baby_defaults_report
from research.baby_defaults_report import TITLE, defaults_section, insert_defaults_section, knob
from research.study_results import algorithm_options, baby_key, baby_specs

BALANCED = {"rigl": {"balance_out_groups": 32}}
DROP = {"rigl": {"drop_fraction": {"type": "cosine", "init": 0.5, "half_period": 1500}}}


FAST = {"rigl": {"update": {"freq": 50, "stop": 1500}}}
SLOW = {"rigl": {"update": {"freq": 100, "stop": 1500}}}  # the study's sections before FAST


@pytest.fixture
def study_runs_fast(monkeypatch):
    """The study file's algorithm_options, pinned: the reports compare against them."""
    monkeypatch.setattr(baby_defaults_report, "study_options", lambda: FAST)


def test_a_sweep_point_runs_only_its_algorithm_with_one_key_changed():
    [task] = baby_specs(None, [0], [0.9], [128], DROP)
    [default] = [t for t in baby_specs(None, [0], [0.9], [128]) if t["variant"] == "rigl"]
    assert task["variant"] == "rigl" and task["options"] == DROP
    changed = {k for k in task["params"]["sparsity"]
               if task["params"]["sparsity"][k] != default["params"]["sparsity"].get(k)}
    assert changed == {"drop_fraction"}
    # the file's own sections are the base, and the task records them
    assert task["params"]["sparsity"]["update"] == default["params"]["sparsity"]["update"]
    assert task["base"] == baby_defaults_report.study_options()
    assert baby_key(default) == ("rigl", 0, 0.9, 128)  # the study's keys stay as they were
    assert baby_key(task) != baby_key(default)
    assert baby_key(task) != baby_key(baby_specs(None, [0], [0.9], [128], BALANCED)[0])
    assert baby_key(task) != baby_key({**task, "base": SLOW})  # same knob, another base


def _run(options: dict | None, seed: int, loss: float, base: dict = SLOW) -> dict:
    run = {"variant": "rigl", "seed": seed, "level": 0.9, "width": 128, "max_steps": 2000,
           "final_ppl": math.exp(loss)}
    return run if options is None else {**run, "options": options, "base": base}


def test_a_knob_is_the_one_leaf_that_differs_from_the_sections_it_ran_from():
    assert knob(_run(DROP, 0, 2.0)) == ("rigl", "drop_fraction.init", 0.5, 0.3)
    assert knob(_run(BALANCED, 0, 2.0)) == ("rigl", "balance_out_groups", 32, None)
    assert knob(_run(FAST, 0, 2.0)) == ("rigl", "update.freq", 50, 100)
    assert knob(_run(SLOW, 0, 2.0, base=FAST)) == ("rigl", "update.freq", 100, 50)
    assert knob(_run({"rigl": {}}, 0, 2.0)) == ("rigl", None, None, None)  # the base's own run
    with pytest.raises(ValueError, match="changes one key"):
        knob(_run({"rigl": {"update": {"freq": 50, "stop": 1000}}}, 0, 2.0))


def test_a_value_replaces_the_default_only_when_better_beyond_the_seed_noise(
        tmp_path: Path, study_runs_fast):
    study = {"runs": [_run(None, s, loss) for s, loss in enumerate((2.176, 2.164, 2.169))]}
    sweep = {"command": "c", "total_wall_s": 600.0, "runs": [
        _run(DROP, 0, 2.150, base=FAST),  # 0.026 better than seed 0's default, sd 0.006
        _run(BALANCED, 0, 2.180, base=FAST)]}  # 0.004 worse: within noise
    text = "\n".join(defaults_section(sweep, study))
    assert "| rigl, 90% | drop fraction (initial, cosine-decayed) | 0.5 | 2.150 |" in text
    assert "| 0.3 (base) (the study's) | 2.170 ± 0.006 |" in text
    assert "| -0.026 | 0.006 | better by 0.026, beyond noise |" in text
    assert "| +0.004 | 0.006 | within noise |" in text
    assert ("drop fraction (initial, cosine-decayed) (rigl, 90%): **change** to 0.5: better by "
            "0.026 beyond noise (0.006), 1 seed; the study runs 0.3: examples/study_baby_gpt.yaml "
            "says why." in text)
    assert "row balancing (balance_out_groups) (rigl, 90%): **keep** off: no value" in text
    page = tmp_path / "results.md"
    page.write_text("# Results\n\n## First\n", encoding="utf-8")
    insert_defaults_section(page, sweep, study)
    assert page.read_text(encoding="utf-8").index(TITLE) < page.read_text().index("## First")


@pytest.mark.parametrize("text", ['{"rigl": 32}', "[]", "{}", "{rigl: 1}"])
def test_options_that_are_not_an_object_of_section_keys_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        algorithm_options(text)
    assert algorithm_options('{"rigl": {"balance_out_groups": 32}}') == BALANCED


def test_a_single_seed_gap_is_judged_by_the_spread_of_the_same_knobs_paired_gaps(study_runs_fast):
    # the sweep ran from SLOW; the study has moved to FAST since, keeping SLOW's runs as the base
    base = [_run({"rigl": {}}, s, loss) for s, loss in enumerate((2.176, 2.164, 2.169))]
    slower = {"rigl": {"update": {"freq": 200, "stop": 1500}}}
    runs = [*base, _run(FAST, 0, 2.108), _run(FAST, 1, 2.119), _run(FAST, 2, 2.158),  # sd 0.029
            _run(slower, 0, 2.196)]  # 0.020 worse: beyond the base's sd 0.006, not beyond 0.029
    study = {"runs": [_run(None, s, 9.0) for s in range(3)]}  # not the sweep's base: unused
    text = "\n".join(defaults_section({"command": "c", "total_wall_s": 1.0, "runs": runs}, study))
    assert "| 100 (base) | 2.170 ± 0.006 |" in text
    assert "| 200 | 2.196 | 8.989 | 1 | +0.020 | 0.029 | within noise |" in text
    assert ("| 50 (the study's) | 2.128 ± 0.026 | 8.403 | 3 | -0.041 ± 0.029 | 0.029 | "
            "better by 0.041" in text)
    assert "**change** to 50: better by 0.041 beyond noise (0.029), 3 seeds; the study runs it now." in text


def test_the_study_rerunning_a_sweep_runs_sections_must_reproduce_it(study_runs_fast):
    sweep = {"command": "c", "total_wall_s": 1.0,
             "runs": [_run({"rigl": {}}, 0, 2.17), _run(FAST, 0, 2.108), _run(FAST, 1, 2.119)]}
    study = {"runs": [_run(None, 0, 2.108), _run(None, 1, 2.120)]}  # seed 1 differs by 0.001
    text = "\n".join(defaults_section(sweep, study))
    assert "Reproduction: 2 of the sweep's runs" in text
    assert "rigl: up to 0.001 apart" in text and "bit for bit" not in text
    same = {"command": "c", "total_wall_s": 1.0, "runs": [_run(FAST, 0, 2.108)]}
    assert "rigl: the same final loss, bit for bit." in "\n".join(defaults_section(same, study))
