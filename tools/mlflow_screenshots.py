"""The MLflow comparison as a person sees it: a tiny study, a real `mlflow server`, headless
Chromium, screenshots.

Runs the reference study's five variants on the tiny model for a few dozen steps (through the
service and Ray in this process), starts `mlflow server` on the study's store, opens the study
experiment in Debian's Chromium (`apt-get install -y chromium`) driven by Playwright and saves

- mlflow_runs_table.png: the study's comparison link in table mode: one named, coloured row
  per variant, best eval perplexity first;
- mlflow_compare_charts.png: the same link as opened (chart view): runs list and charts;
- mlflow_perplexity_chart.png: its eval/perplexity chart enlarged, one line per variant;
- mlflow_perplexity_after_warmup.png: its eval/perplexity_after_warmup chart enlarged: the
  same lines from the first evaluation after the LR warm-up, on an axis of the late values;
- mlflow_final_perplexity.png: its final/eval_perplexity chart enlarged, one point per variant;
- mlflow_parent_run.png: the parent run's page (its description links the comparison);
- mlflow_run_metrics.png: a RigL variant's "Model metrics" tab: the headline sections (eval,
  final, ...) on top;
- mlflow_layer_sparsity.png: the same tab scrolled to the per-layer section
  (`weights/sparsity`, one chart per layer under its short name).

    .venv/bin/python tools/mlflow_screenshots.py --out docs/images

Prints the study's final perplexities and the paths written. Exits 2 when Chromium or
Playwright is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1600, "height": 1000}


def tiny_study(steps: int) -> dict[str, Any]:
    """The reference study's five variants on the tiny model for `steps` steps, 1 system each."""
    return {
        "name": "screenshot-study", "algorithms": ["dense", "static", "set", "rigl", "granet"],
        "sparsity": 0.8,
        "train_input": {"data_dir": "builtin:shakespeare", "batch_size": 8,
                        "max_sequence_length": 64, "shuffle": True},
        "eval_input": {"batch_size": 8, "max_sequence_length": 64},
        "model": {"preset": "tiny"},
        # a warm-up, as the reference study has: eval/perplexity_after_warmup starts after it
        "optimizer": {"optimizer_type": "AdamW", "weight_decay": 0.1, "max_gradient_norm": 1.0,
                      "learning_rate": [
                          {"scheduler": "Linear", "initial_learning_rate": 0.0,
                           "end_learning_rate": 3.0e-3, "total_iters": max(1, steps // 8)},
                          {"scheduler": "Constant", "learning_rate": 3.0e-3}]},
        "runconfig": {"max_steps": steps, "eval_frequency": max(1, steps // 8), "eval_steps": 2,
                      "log_steps": max(1, steps // 16), "seed": 0, "num_csx": 1,
                      "mlflow_experiment": "csx-screenshot-study"},
    }


def run_study(state: Path, body: dict[str, Any], timeout_s: float) -> tuple[str, dict]:
    """Run the study through the service (in process, Ray local); (tracking URI, report)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from fastapi.testclient import TestClient

    from service import crud
    from service.main import create_app
    from service.settings import Settings

    tracking_uri = f"sqlite:///{state / 'mlflow.db'}"
    settings = Settings(database_url=f"sqlite:///{state / 'csx.db'}", runs_dir=state / "runs",
                        mlflow_tracking_uri=tracking_uri, cluster_size=2,
                        allowed_data_roots=[state])
    # In this (main) thread: a runtime started from a job's thread dies with that thread.
    ray.init(address="local", include_dashboard=False, num_cpus=2, resources={"csx": 2},
             log_to_driver=False, configure_logging=False)
    try:
        with TestClient(create_app(settings)) as client:
            with client.app.state.sessionmaker() as session:
                _, secret = crud.create_token(session, name="screenshots", is_admin=False)
                session.commit()
            headers = {"Authorization": f"Bearer {secret}"}
            created = client.post("/v1/studies", json=body, headers=headers)
            if created.status_code != 201:
                raise SystemExit(f"study refused: {created.status_code} {created.text}")
            study_id = created.json()["id"]
            deadline = time.monotonic() + timeout_s
            while client.get(f"/v1/studies/{study_id}", headers=headers).json()["status"] != "DONE":
                if time.monotonic() > deadline:
                    raise SystemExit(f"the study did not finish within {timeout_s:.0f} s")
                time.sleep(1.0)
            report = client.get(f"/v1/studies/{study_id}/report", headers=headers).json()
    finally:
        ray.shutdown()
    return tracking_uri, report


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_mlflow_server(tracking_uri: str, log: Path) -> tuple[subprocess.Popen, str]:
    """`mlflow server` on loopback, lean (one worker, no job execution); waits for /health."""
    import httpx

    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", tracking_uri],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"mlflow server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    server.kill()
    raise SystemExit("mlflow server did not answer /health within 90 s")


def screenshots(url: str, experiment_id: str, parent_run_id: str, study_id: int,
                variants: dict[str, str], out: Path) -> list[Path]:
    """Open the study in Chromium as a user would and save what they see."""
    from playwright.sync_api import sync_playwright

    from service.studies import compare_link

    compare = f"{url}/{compare_link(experiment_id, study_id)}"
    written: list[Path] = []
    profile = tempfile.mkdtemp(prefix="csx-chromium-")
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
                viewport=VIEWPORT)
            page = browser.new_page()
            page.set_default_timeout(60_000)

            # The runs table of the comparison: one named, coloured row per variant.
            page.goto(compare.replace("compareRunsMode=CHART&", ""))
            close_assistant(page)
            for variant in variants:
                page.get_by_role("link", name=variant, exact=True).first.wait_for()
            written.append(shot(page, out / "mlflow_runs_table.png"))

            # The chart view, then its perplexity charts enlarged: the curves, the curves after
            # the warm-up, and the finals (one point per variant, on an axis that tells them
            # apart); each legend names every variant.
            page.goto(compare)
            close_assistant(page)
            page.get_by_text("eval/perplexity", exact=True).first.wait_for()
            written.append(shot(page, out / "mlflow_compare_charts.png"))
            for metric, image in (("eval/perplexity", "mlflow_perplexity_chart.png"),
                                  ("eval/perplexity_after_warmup",
                                   "mlflow_perplexity_after_warmup.png"),
                                  ("final/eval_perplexity", "mlflow_final_perplexity.png")):
                dialog = enlarge(page, metric)
                for variant in variants:
                    dialog.get_by_text(f"{variant} ({metric})").first.wait_for()
                written.append(shot(dialog, out / image))
                page.keyboard.press("Escape")

            # The parent run: its description links the comparison; its artifacts the report.
            page.goto(f"{url}/#/experiments/{experiment_id}/runs/{parent_run_id}")
            close_assistant(page)
            page.get_by_text("Compare the variants").first.wait_for()
            written.append(shot(page, out / "mlflow_parent_run.png"))

            # A variant's own charts: headline sections first, per-layer ones after them.
            page.goto(f"{url}/#/experiments/{experiment_id}/runs/{variants['rigl']}/model-metrics")
            close_assistant(page)
            page.get_by_text("eval/perplexity", exact=False).first.wait_for()
            written.append(shot(page, out / "mlflow_run_metrics.png"))
            section = page.get_by_text("weights/sparsity", exact=True).first
            section.evaluate("e => e.scrollIntoView({block: 'start'})")
            written.append(shot(page, out / "mlflow_layer_sparsity.png"))
            browser.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    return written


def enlarge(page: Any, metric: str) -> Any:
    """Open `metric`'s chart card full screen; returns its dialog."""
    card = page.locator("[data-testid='experiment-view-compare-runs-card']").filter(
        has=page.get_by_text(metric, exact=True)).first
    card.scroll_into_view_if_needed()
    card.hover()
    card.locator("[data-component-id='fullscreen_button_chartcard']").click()
    return page.get_by_role("dialog").first


def close_assistant(page: Any) -> None:
    """MLflow 3 opens an assistant panel over a third of the page; close it when shown."""
    close = page.locator("[data-component-id='mlflow.assistant.chat_panel.close']")
    try:
        close.first.click(timeout=5_000)
    except Exception:  # noqa: BLE001 - playwright's TimeoutError: no panel this time
        pass


def shot(target: Any, path: Path) -> Path:
    """Screenshot once the charts' first-draw animation has settled."""
    time.sleep(2.0)
    target.screenshot(path=path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--state", type=Path, default=None,
                        help="reuse this folder's study (csx.db, mlflow.db) instead of a new run")
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args(argv)
    if not Path(CHROMIUM).exists():
        print(f"{CHROMIUM} is missing: apt-get install -y chromium", file=sys.stderr)
        return 2
    try:
        import playwright  # noqa: F401
    except ImportError:
        print("playwright is missing: pip install playwright (no browser download needed)",
              file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the machine's cores go to the Ray workers
    state = args.state or Path(tempfile.mkdtemp(prefix="csx-mlflow-shots-"))
    state.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    tracking_uri = f"sqlite:///{state / 'mlflow.db'}"
    if not (state / "mlflow.db").exists():
        started = time.perf_counter()
        tracking_uri, report = run_study(state, tiny_study(args.steps), timeout_s=1800)
        print(f"study: {time.perf_counter() - started:.0f} s")
        for row in report["rows"]:
            print(f"  {row['variant']:<8} {row['status']:<10} final ppl "
                  f"{row['final_eval_perplexity']:.3f}")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("csx-screenshot-study")
    parent = client.search_runs([experiment.experiment_id], "tags.`csx.role` = 'study'")[0]
    variants = {r.info.run_name: r.info.run_id for r in client.search_runs(
        [experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")}
    server, url = start_mlflow_server(tracking_uri, state / "mlflow-server.log")
    try:
        for path in screenshots(url, experiment.experiment_id, parent.info.run_id,
                                int(parent.data.tags["csx.study_id"]), variants,
                                args.out):
            print(f"wrote {path}")
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
    print(f"state: {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
