"""The study comparison link in a real browser: `mlflow server` and Debian's Chromium (headless,
driven by Playwright) show one named line per variant and no parent run. Chromium comes
from Debian's packages (tests/service/chromium.sh); tools/mlflow_screenshots.py is the full
end-to-end version (a real study, the screenshots in docs/images/ shown by docs/studies.md)."""

from __future__ import annotations

import importlib.util
import os
import signal
import re
import subprocess
from pathlib import Path

import pytest
from mlflow import MlflowClient

from service.studies import VARIANT_COLOURS, compare_link
from tracking.tracker import Tracker, create_run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def load_screenshots():
    spec = importlib.util.spec_from_file_location(
        "mlflow_screenshots", ROOT / "tools" / "mlflow_screenshots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's Chromium, installed by tests/service/chromium.sh when missing (as pg.sh does
    for PostgreSQL); the test fails, not skips, where it cannot be had."""
    found = subprocess.run(["bash", str(ROOT / "tests" / "service" / "chromium.sh")],
                           capture_output=True, text=True)
    if found.returncode != 0:
        pytest.fail(found.stderr.strip() or "tests/service/chromium.sh failed")
    return found.stdout.strip()


# The reference study's last `make results` finals (docs/results.md): a few tenths apart.
FINAL_PPL = {"dense": 6.278, "set": 6.722, "static": 6.814, "granet": 6.823, "rigl": 6.876}


def log_study(uri: str) -> str:
    """A parent run and five variants logged as the workers log them (`Tracker`): perplexity
    curves from 250 down to finals a few tenths apart; returns the experiment id."""
    parent = create_run("ui-study", tracking_uri=uri, run_name="the-parent",
                        tags={"csx.study_id": "3", "csx.role": "study"})
    for index, (variant, final) in enumerate(FINAL_PPL.items()):
        run_id = create_run("ui-study", tracking_uri=uri, parent_run_id=parent, run_name=variant,
                            tags={"csx.study_id": "3", "csx.role": "variant",
                                  "csx.variant": variant,
                                  "mlflow.runColor": VARIANT_COLOURS[index]})
        tracker = Tracker("ui-study", run_id=run_id, tracking_uri=uri)
        level = 0.0 if variant == "dense" else 0.8
        for step in range(0, 101, 10):
            tracker.log_metrics({"eval/perplexity": final + 250 * 0.6 ** step,
                                 "train/loss": 2 + 3 * 0.6 ** step, "sparsity/global": level,
                                 "perf/sim_step_ms": 1.0 - level / 2, "lr": 1e-3}, step=step)
            if level:  # what the library's alg.metrics() gives, as train() hands it over
                tracker.log_metrics({f"sparsity/{layer}/{kind}": level for layer in LAYERS
                                     for kind in ("target", "actual")}, step=step)
        tracker.finish()
    return MlflowClient(uri).get_experiment_by_name("ui-study").experiment_id


LAYERS = [f"transformer_decoder.layers.{i}.{part}.weight" for i in range(2) for part in (
    "self_attn.proj_q_dense_layer", "self_attn.proj_output_dense_layer",
    "ffn.ffn.0.linear_layer_for_glu", "ffn.ffn.1.linear_layer")]
HEADLINE = ("eval", "final", "perf", "sparsity", "train")


def chart_sections(page) -> list[str]:
    """The chart sections' headings in page order ("eval (2)" reads "eval\n(2)")."""
    page.get_by_text("weights/sparsity", exact=True).first.wait_for()
    return re.findall(r"^(\S+)\n\(\d+\)$", page.inner_text("body"), flags=re.MULTILINE)


def assert_headline_first(sections: list[str]) -> None:
    """eval/perplexity's section on top; every headline section before any per-layer one."""
    assert sections[0] == "eval", sections
    per_layer = [i for i, name in enumerate(sections) if name.startswith("weights/")]
    assert [sections[i] for i in per_layer] == ["weights/sparsity", "weights/target"], sections
    assert max(sections.index(name) for name in HEADLINE) < min(per_layer), sections


@pytest.mark.timeout(240)
def test_compare_link_shows_five_variants_and_readable_final_perplexities(tmp_path, tracking_uri,
                                                                           chromium):
    screenshots = load_screenshots()
    experiment_id = log_study(tracking_uri)  # the session's store: its schema exists already
    server, url = screenshots.start_mlflow_server(tracking_uri, tmp_path / "server.log")
    try:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as playwright:
            browser = playwright.chromium.launch_persistent_context(
                str(tmp_path / "profile"), executable_path=chromium, headless=True,
                args=screenshots.CHROMIUM_FLAGS, viewport=screenshots.VIEWPORT)
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(f"{url}/{compare_link(experiment_id, 3)}")
            screenshots.close_assistant(page)
            # the link opens the runs of a model-training experiment, not the GenAI overview
            page.get_by_role("link", name="rigl", exact=True).first.wait_for()
            assert "Traces\n0" not in page.inner_text("body")
            compare_sections = chart_sections(page)
            curves = screenshots.enlarge(page, "eval/perplexity")
            for variant in FINAL_PPL:
                curves.get_by_text(f"{variant} (eval/perplexity)").wait_for()
            curves_text = curves.inner_text()
            page.keyboard.press("Escape")
            finals = screenshots.enlarge(page, "final/eval_perplexity")
            for variant in FINAL_PPL:
                finals.get_by_text(f"{variant} (final/eval_perplexity)").wait_for()
            finals_text = finals.inner_text()
            page.keyboard.press("Escape")
            # a variant's own page: the same sections, per-layer charts titled by short names
            rigl = MlflowClient(tracking_uri).search_runs(
                [experiment_id], "attributes.run_name = 'rigl'")[0].info.run_id
            page.goto(f"{url}/#/experiments/{experiment_id}/runs/{rigl}/model-metrics")
            run_sections = chart_sections(page)
            # charts draw when scrolled to: the per-layer section's
            page.get_by_text("weights/sparsity", exact=True).first.scroll_into_view_if_needed()
            title = page.get_by_text("L01.attn.output", exact=True).first
            title.wait_for()
            title_fits = title.evaluate("e => e.scrollWidth <= e.clientWidth")
            browser.close()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    assert_headline_first(compare_sections)
    assert_headline_first(run_sections)
    assert title_fits, "the per-layer chart's title is cut off"
    assert "the-parent" not in curves_text + finals_text
    assert all(curves_text.count(f"{v} (eval/perplexity)") == 1 for v in FINAL_PPL), curves_text
    # The one-point final chart spans only the finals (6.28 to 6.88), with ticks a tenth
    # apart, so 0.1 differences are visible; the curves' axis runs to 250.
    numbers = [float(line) for line in finals_text.splitlines() if re.fullmatch(r"\d+(\.\d+)?", line)]
    ticks = [n for n in numbers if n < 90]  # the others are the x-axis: steps around 100
    assert len(ticks) >= 5 and min(ticks) >= 6.0 and max(ticks) <= 7.0, finals_text
    assert all(round(b - a, 6) <= 0.1 for a, b in zip(ticks, ticks[1:])), finals_text
