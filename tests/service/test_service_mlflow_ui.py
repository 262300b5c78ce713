"""The study comparison link in a real browser: `mlflow server` and Debian's Chromium (headless,
driven by Playwright) show one named line per variant and no parent run. Chromium comes
from Debian's packages (tests/service/chromium.sh); bench/mlflow_screenshots.py is the full
end-to-end version (a real study, screenshots for the README)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from service.studies import VARIANT_COLOURS, compare_link
from workers.tracking import create_run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
VARIANTS = ["rigl", "set", "granet"]


def load_bench():
    spec = importlib.util.spec_from_file_location(
        "mlflow_screenshots", ROOT / "bench" / "mlflow_screenshots.py")
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


@pytest.mark.timeout(180)
def test_compare_link_shows_each_variant_once_and_no_parent(tmp_path, tracking_uri, chromium):
    bench = load_bench()
    uri = tracking_uri  # the session's store: its schema exists already
    client = MlflowClient(uri)
    parent = create_run("ui-study", tracking_uri=uri, run_name="the-parent",
                        tags={"csx.study_id": "3", "csx.role": "study"})
    for index, variant in enumerate(VARIANTS):
        run_id = create_run("ui-study", tracking_uri=uri, parent_run_id=parent, run_name=variant,
                            tags={"csx.study_id": "3", "csx.role": "variant",
                                  "csx.variant": variant,
                                  "mlflow.runColor": VARIANT_COLOURS[index]})
        client.log_batch(run_id, metrics=[Metric("eval/perplexity", 40.0 - 5 * step - index, 0,
                                                 step) for step in range(1, 4)])
    experiment_id = client.get_experiment_by_name("ui-study").experiment_id
    server, url = bench.start_mlflow_server(uri, tmp_path / "server.log")
    try:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as playwright:
            browser = playwright.chromium.launch_persistent_context(
                str(tmp_path / "profile"), executable_path=chromium, headless=True,
                args=bench.CHROMIUM_FLAGS, viewport=bench.VIEWPORT)
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(f"{url}/{compare_link(experiment_id, 3)}")
            bench.close_assistant(page)
            card = page.locator("[data-testid='experiment-view-compare-runs-card']").filter(
                has=page.get_by_text("eval/perplexity", exact=True)).first
            card.hover()
            card.locator("[data-component-id='fullscreen_button_chartcard']").click()
            legend = page.get_by_role("dialog").first
            for variant in VARIANTS:
                legend.get_by_text(f"{variant} (eval/perplexity)").wait_for()
            text = legend.inner_text()
            browser.close()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    assert "the-parent" not in text
    assert all(text.count(f"{variant} (eval/perplexity)") == 1 for variant in VARIANTS), text
