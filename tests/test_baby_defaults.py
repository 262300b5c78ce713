"""The baby-GPT study's defaults sweep (issue 34, item 3): its tasks, its keys and its verdicts."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from research.baby_defaults_report import TITLE, defaults_section, insert_defaults_section, knob
from research.study_results import algorithm_options, baby_key, baby_specs

BALANCED = {"rigl": {"balance_out_groups": 32}}
DROP = {"rigl": {"drop_fraction": {"type": "cosine", "init": 0.5, "half_period": 1500}}}


def test_a_sweep_point_runs_only_its_algorithm_with_one_key_changed():
    [task] = baby_specs(None, [0], [0.9], [128], DROP)
    [default] = [t for t in baby_specs(None, [0], [0.9], [128]) if t["variant"] == "rigl"]
    assert task["variant"] == "rigl" and task["options"] == DROP
    changed = {k for k in task["params"]["sparsity"]
               if task["params"]["sparsity"][k] != default["params"]["sparsity"].get(k)}
    assert changed == {"drop_fraction"}
    assert task["params"]["sparsity"]["update"] == {"freq": 100, "stop": 1500}  # the file's
    assert baby_key(default) == ("rigl", 0, 0.9, 128)  # the study's keys stay as they were
    assert baby_key(task) != baby_key(default)
    assert baby_key(task) != baby_key(baby_specs(None, [0], [0.9], [128], BALANCED)[0])


def _run(options: dict | None, seed: int, loss: float) -> dict:
    run = {"variant": "rigl", "seed": seed, "level": 0.9, "width": 128, "max_steps": 2000,
           "final_ppl": math.exp(loss)}
    return run if options is None else {**run, "options": options}


def test_a_knob_is_the_one_leaf_that_differs_from_the_files_section():
    assert knob(_run(DROP, 0, 2.0)) == ("rigl", "drop_fraction.init", 0.5, 0.3)
    assert knob(_run(BALANCED, 0, 2.0)) == ("rigl", "balance_out_groups", 32, None)
    freq = {"rigl": {"update": {"freq": 50, "stop": 1500}}}
    assert knob(_run(freq, 0, 2.0)) == ("rigl", "update.freq", 50, 100)
    with pytest.raises(ValueError, match="changes one key"):
        knob(_run({"rigl": {"update": {"freq": 50, "stop": 1000}}}, 0, 2.0))


def test_a_value_replaces_the_default_only_when_better_beyond_the_seed_noise(tmp_path: Path):
    study = {"runs": [_run(None, s, loss) for s, loss in enumerate((2.176, 2.164, 2.169))]}
    sweep = {"command": "c", "total_wall_s": 600.0, "runs": [
        _run(DROP, 0, 2.150),  # 0.026 better than seed 0's default, sd 0.006
        _run(BALANCED, 0, 2.180)]}  # 0.004 worse: within noise
    text = "\n".join(defaults_section(sweep, study))
    assert "| rigl, 90% | drop fraction (initial, cosine-decayed) | 0.5 | 2.150 |" in text
    assert "| -0.026 | 0.006 | better by 0.026, beyond noise |" in text
    assert "| +0.004 | 0.006 | within noise |" in text
    assert ("drop fraction (initial, cosine-decayed) (rigl, 90%): **change** to 0.5: better by "
            "0.026 beyond noise (0.006), 1 seed." in text)
    assert "row balancing (balance_out_groups) (rigl, 90%): **keep** off" in text
    page = tmp_path / "results.md"
    page.write_text("# Results\n\n## First\n", encoding="utf-8")
    insert_defaults_section(page, sweep, study)
    assert page.read_text(encoding="utf-8").index(TITLE) < page.read_text().index("## First")


@pytest.mark.parametrize("text", ['{"rigl": 32}', "[]", "{}", "{rigl: 1}"])
def test_options_that_are_not_an_object_of_section_keys_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        algorithm_options(text)
    assert algorithm_options('{"rigl": {"balance_out_groups": 32}}') == BALANCED


def test_a_single_seed_gap_is_judged_by_the_spread_of_the_same_knobs_paired_gaps():
    study = {"runs": [_run(None, s, loss) for s, loss in enumerate((2.176, 2.164, 2.169))]}
    freq = {"rigl": {"update": {"freq": 50, "stop": 1500}}}
    slow = {"rigl": {"update": {"freq": 200, "stop": 1500}}}
    runs = [_run(freq, 0, 2.108), _run(freq, 1, 2.119), _run(freq, 2, 2.158),  # gaps sd 0.029
            _run(slow, 0, 2.196)]  # 0.020 worse: beyond the default's sd 0.006, not beyond 0.029
    text = "\n".join(defaults_section({"command": "c", "total_wall_s": 1.0, "runs": runs}, study))
    assert "| 200 | 2.196 | 8.989 | 1 | +0.020 | 0.029 | within noise |" in text
    assert "| 50 | 2.128 ± 0.026 | 8.403 | 3 | -0.041 ± 0.029 | 0.029 | better by 0.041" in text
