"""research/blog_report.py: the blog's claims judged against seed noise; where the section goes."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from research.blog_report import TITLE, claim_verdict, insert_blog_section, reproduces

PPL = st.lists(st.floats(1.0, 20.0, allow_nan=False), min_size=1, max_size=5)


@settings(max_examples=80)
@given(better=PPL, worse=PPL)
def test_a_claim_gap_is_the_mean_difference_and_counts_beyond_the_larger_sd(
        better: list[float], worse: list[float]):
    gap, noise, real = claim_verdict(better, worse)
    assert gap == pytest.approx(sum(worse) / len(worse) - sum(better) / len(better))
    assert real == (min(len(better), len(worse)) > 1 and abs(gap) > noise)
    flipped_gap, flipped_noise, _ = claim_verdict(worse, better)
    assert flipped_gap == pytest.approx(-gap) and flipped_noise == noise


def test_reproduction_needs_every_blog_claim_beyond_seed_noise():
    ordered = {"set": [6.60, 6.62, 6.61], "rigl": [6.50, 6.52, 6.51], "granet": [6.40, 6.41, 6.42],
               "static": [6.90, 6.91, 6.92]}
    assert reproduces(ordered)
    assert not reproduces({**ordered, "granet": [6.45, 6.60, 6.50]})  # GraNet < RigL within noise
    assert not reproduces({**ordered, "static": [6.55, 6.56, 6.57]})  # SET now behind Static


def test_the_section_goes_after_the_title_and_keeps_the_page(tmp_path: Path):
    page = tmp_path / "results.md"
    page.write_text("# Results\n\nIntro.\n\n## First\n\nbody\n\n## Second\n", encoding="utf-8")
    run = {"variant": "dense", "seed": 0, "final_ppl": 6.0, "wall_s": 1.0, "metrics": {},
           "batch_size": 16, "max_steps": 1000}
    sparse = {**run, "variant": "static", "final_ppl": 7.0, "batch_size": 8, "max_steps": 2000}
    control = {**run, "variant": "dense-half-batch", "final_ppl": 5.5}
    blog = {"command": "c", "total_wall_s": 60.0, "complete": False,
            "runs": [run, sparse, control]}
    insert_blog_section(page, blog, {"runs": [run, {**sparse, "batch_size": 16}]})
    text = page.read_text(encoding="utf-8")
    assert text.startswith("# Results\n\nIntro.\n\n" + TITLE)
    assert text.index(TITLE) < text.index("## First") < text.index("## Second")
    assert "**Partial:** 3 runs finished" in text
    assert "reaches 5.500 against 6.000 at the full batch (-0.500, within the seed sd" in text
    assert "| static | 7.000 | 7.000 | +0.000 | no (sd 0.000) | 1 | 7.000 |" in text
    assert "(8 × 128, 2000 steps)" in text
