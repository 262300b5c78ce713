"""The baby-GPT study (issue 34): its task list, paired gaps, claim verdicts and page section."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from research.baby_report import TITLE, claim_line, insert_baby_section, paired_gap
from research.study_results import baby_key, baby_specs

LOSSES = st.dictionaries(st.integers(0, 4), st.floats(1.0, 3.0, allow_nan=False), min_size=1)


@settings(max_examples=60)
@given(better=LOSSES, worse=LOSSES)
def test_a_paired_gap_differences_only_the_seeds_both_ran(better, worse):
    diffs, _ = paired_gap(better, worse)
    common = sorted(better.keys() & worse.keys())
    assert diffs == pytest.approx([worse[s] - better[s] for s in common])


def test_a_claim_is_judged_against_seed_noise_and_says_when_there_is_none():
    static = {0: 2.08, 1: 2.06, 2: 2.10}
    beyond = claim_line("set", "static", {"set": {0: 2.00, 1: 2.01, 2: 2.02}, "static": static})
    assert "holds, beyond seed noise" in beyond
    assert "| +0.070 ± 0.017 |" in beyond  # paired: per-seed gaps 0.08, 0.05, 0.08
    assert "t = 7.0 on 2 df (p < 0.05)" in beyond  # 0.070 / (0.017 / √3), critical 4.30
    spread = claim_line("set", "static", {"set": {0: 2.00, 1: 2.10, 2: 2.00}, "static": static})
    assert "t = 1.1 on 2 df (p ≥ 0.05)" in spread  # gaps 0.08, -0.04, 0.10
    assert "reversed, within seed noise" in claim_line("rigl", "static", {
        "rigl": {0: 2.09, 1: 2.07, 2: 2.11}, "static": static})
    assert "1 seed: no noise estimate" in claim_line("rigl", "static", {
        "rigl": {0: 2.0}, "static": static})
    assert "not run" in claim_line("granet", "rigl", {"rigl": static})


def test_the_tasks_go_seed_by_seed_with_dense_once_per_width():
    tasks = baby_specs(None, [0, 1], [0.8, 0.9], [64, 128])
    keys = [baby_key(t) for t in tasks]
    assert len(keys) == len(set(keys)) == 2 * (2 * 6 + 2 * 5)  # dense has no 90% run
    assert keys[:6] == [(v, 0, None if v == "dense" else 0.8, 64)
                        for v in ("dense", "static", "set", "rigl", "granet", "rigl-sinkhorn")]
    assert [t["seed"] for t in tasks[:12]] == [0] * 6 + [1] * 6  # a whole seed first
    first = tasks[0]["params"]
    assert first["model"]["hidden_size"] == 64 and first["model"]["filter_size"] == 256
    rigl = next(t for t in tasks if t["variant"] == "rigl" and t["level"] == 0.9)["params"]
    assert rigl["sparsity"]["sparsity"] == 0.9 and "balance_out_groups" not in rigl["sparsity"]
    assert rigl["sparsity"]["update"] == {"freq": 50, "stop": 1500}  # the defaults sweep's pick
    sinkhorn = next(t for t in tasks if t["variant"] == "rigl-sinkhorn" and t["level"] == 0.9)
    assert sinkhorn["params"]["sparsity"] == {**rigl["sparsity"], "grow_score_scaling": "sinkhorn"}
    assert rigl["runconfig"]["seed"] == 0 and rigl["optimizer"]["betas"] == [0.9, 0.99]


def test_the_section_leads_the_page_with_the_dense_anchor(tmp_path: Path):
    page = tmp_path / "results.md"
    page.write_text("# Results\n\nIntro.\n\n## First\n\nbody\n", encoding="utf-8")
    run = {"variant": "dense", "seed": 0, "level": None, "width": 128, "wall_s": 70.0,
           "final_ppl": math.exp(1.9), "max_steps": 2000, "params": 1}
    update = {"freq": 50, "stop": 1500}
    runs = [run, *({**run, "variant": v, "level": 0.8, "final_ppl": math.exp(2.0 + i / 100),
                    "sparsity": {"algorithm": v} | ({"update": update} if v != "static" else {})}
                   for i, v in enumerate(("static", "set", "rigl", "granet")))]
    insert_baby_section(page, {"command": "c", "total_wall_s": 60.0, "complete": False,
                               "runs": runs}, tmp_path)
    text = page.read_text(encoding="utf-8")
    assert text.startswith("# Results\n\nIntro.\n\n" + TITLE)
    assert text.index(TITLE) < text.index("## First")
    assert "dense reaches a validation loss of 1.900 (1 seed)" in text
    assert "| set | 2.010 | 1 | 2.010 | +0.010 | +0.110 | 70 |" in text
    assert "| rigl < static | static − rigl -0.020 | -0.020 | reversed, 1 seed" in text
    assert "a mask update every 50 steps to step 1500" in text  # what the runs recorded
    runs[-1]["sparsity"]["update"] = {"freq": 100, "stop": 1500}  # a run from before a change
    insert_baby_section(page, {"command": "c", "total_wall_s": 60.0, "runs": runs}, tmp_path)
    assert "mask updates on mixed schedules" in page.read_text(encoding="utf-8")


def test_a_side_sweep_merges_its_new_runs_and_commands(tmp_path: Path, monkeypatch):
    import research.study_results as study_results

    main, side = tmp_path / "main.json", tmp_path / "side.json"
    monkeypatch.setattr(study_results, "BABY_RESULTS", main)
    dense = {"variant": "dense", "seed": 0, "level": None, "width": 128}
    rigl = {**dense, "variant": "rigl", "level": 0.9}
    main.write_text(json.dumps({"commands": ["a"], "seeds": [0, 1], "total_wall_s": 10.0,
                                "complete": False, "runs": [dense]}))
    side.write_text(json.dumps({"commands": ["b"], "seeds": [0], "total_wall_s": 5.0,
                                "complete": True, "runs": [{**dense, "wall_s": 1}, rigl]}))
    study_results.merge_baby(side)
    merged = json.loads(main.read_text())
    assert merged["runs"] == [dense, rigl]  # the main file's dense run wins
    assert merged["commands"] == ["a", "b"] and merged["command"] == "a && b"
    assert merged["total_wall_s"] == 15.0 and merged["seeds"] == [0, 1]
    assert merged["complete"] is False
