"""The guide's commands that train or talk to a service, run the way a reader runs them.

README.md and the site's pages (tests/guide_blocks.py collects their blocks in guide order and
classifies every shell line; tests/test_docs.py runs the fast ones). Lines run as written in a
bash that first sources the README's activation line (with this interpreter's virtualenv for
`.venv`, its `bin` taken off PATH, so a command that needs activation fails without it), from a
folder holding `examples/`, so nothing is written into the clone. Training and service lines
run against a local stack (`service.local_stack.LocalStack`, what `make run` starts), with
`examples/*.yaml` swapped for tiny copies (4 steps) and the API address for the stack's.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from guide_blocks import (
    ACTIVATE,
    README_API,
    ROOT,
    VENV_BIN,
    FENCE,
    commands,
    lines_of,
    reader_environment,
    reader_folder,
    reader_shell,
)

TINY_STEPS = 4


def readme_lines() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return [line for language, text in FENCE.findall(readme) if language == "bash"
            for line in commands(text)]


def tiny(example: str, folder: Path) -> Path:
    data = yaml.safe_load((ROOT / "examples" / example).read_text())
    data["train_input"] = {**data["train_input"], "batch_size": 4, "max_sequence_length": 16}
    data["eval_input"] = {"batch_size": 4, "max_sequence_length": 16}
    data["runconfig"] = {**data["runconfig"], "max_steps": TINY_STEPS, "eval_frequency": 2,
                         "eval_steps": 1, "checkpoint_steps": 0, "log_steps": 2}
    if "algorithms" in data:
        data["algorithms"] = ["dense", "rigl"]
    path = folder / "tiny" / example
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def test_activation_comes_before_the_first_venv_command():
    """A reader going top to bottom activates the virtualenv before the first `csx`/`mlflow`."""
    lines = readme_lines()
    first_venv = next(i for i, line in enumerate(lines) if re.match(r"(csx|mlflow) ", line))
    assert ACTIVATE in lines[:first_venv]


def test_without_activation_csx_is_not_found(tmp_path):
    """What the activation line is for: the reader's PATH has no `csx` before it."""
    done = subprocess.run(["bash", "-c", "csx --help"], cwd=tmp_path, env=reader_environment(),
                          capture_output=True, text=True)
    assert done.returncode == 127 and "command not found" in done.stderr


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from service.local_stack import LocalStack

    with LocalStack(tmp_path_factory.mktemp("stack"), cluster_size=4) as running:
        yield running


@pytest.mark.slow
def test_stack_lines_run_in_order(stack, tmp_path):
    """Training, service and REST lines in guide order: preprocessing feeds the porting
    run, training feeds `csx finalize`, the studies land in the stack's store."""
    folder = reader_folder(tmp_path)
    swaps = {f"examples/{name}": str(tiny(name, folder)) for name in ("rigl.yaml", "study.yaml")}
    swaps |= {"runconfig.max_steps=200": f"runconfig.max_steps={TINY_STEPS}",
              "checkpoint_200.mdl": f"checkpoint_{TINY_STEPS}.mdl", README_API: stack.api_url}
    # As a reader's shell: `csx run` starts its own Ray and logs to ./mlflow.db; only the
    # service's address and token come from the stack.
    env = reader_environment({"CSX_URL": stack.api_url, "CSX_TOKEN": stack.token})
    for name in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI"):
        env.pop(name, None)
    run = reader_shell(folder, env, swaps)
    outputs = {line: run(line) for line in lines_of("stack")}
    trained = [out for line, out in outputs.items() if line.startswith("csx run ")
               and "--validate_only" not in line]
    assert len(trained) >= 2 and all(f'"steps": {TINY_STEPS}' in out for out in trained)
    assert (folder / "data" / "shakespeare" / "data-00000.h5").is_file()
    assert (folder / "runs" / "rigl" / "final.mdl").is_file()
    headers = {"Authorization": f"Bearer {stack.token}"}
    studies = [httpx.get(f"{stack.api_url}/v1/studies/{i}", headers=headers).json()
               for i in (1, 2)]
    assert [len(s["jobs"]) for s in studies] == [2, 2]  # study.yaml (tiny: 2 variants), csx study
    jobs = httpx.get(f"{stack.api_url}/v1/jobs", headers=headers).json()
    assert jobs["count"] == 6  # POST /jobs, csx submit, and the 4 variants


@pytest.mark.slow
def test_a_copied_store_opens_with_the_readme_line_after_the_original_is_gone(tmp_path):
    """Runs logged the way the stack logs them (through `mlflow ui` with the stack's flags),
    the state folder copied and the original deleted: the guide's `mlflow ui` line (port
    swapped for a free one), run beside the copy, serves the runs and their artifacts."""
    import shutil
    import sqlite3

    import torch
    from mlflow import MlflowClient

    from service.processes import (
        MLFLOW_ARTIFACTS,
        MLFLOW_STORE,
        StackProcess,
        free_port,
        mlflow_ui_argv,
        wait_until_up,
    )
    from tracking.tracker import Tracker

    env = reader_environment({"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    original = tmp_path / "first" / ".csx"
    original.mkdir(parents=True)
    port = free_port()
    ui = StackProcess.start("mlflow ui", mlflow_ui_argv(original / MLFLOW_STORE,
                                                            original / MLFLOW_ARTIFACTS, port), env=env,
                            log_path=tmp_path / "first.log", cwd=original)
    try:
        wait_until_up(f"http://127.0.0.1:{port}/health", ui, timeout_s=120)
        tracker = Tracker("copied-store", tracking_uri=f"http://127.0.0.1:{port}")
        tracker.log_text("kept across the move", "notes/hello.txt")
        tracker.log_mask_update(0, {"fc.weight": torch.ones(4, 4, dtype=torch.bool)})
        tracker.finish()
    finally:
        ui.stop()
    with sqlite3.connect(original / "mlflow.db") as db:
        uris = [row[0] for row in db.execute("select artifact_uri from runs")]
    assert uris and all(uri.startswith("mlflow-artifacts:/") for uri in uris)  # no absolute path

    elsewhere = tmp_path / "second"
    shutil.copytree(original, elsewhere / ".csx")
    shutil.rmtree(tmp_path / "first")
    (ui_line,) = lines_of("server")
    port = free_port()
    activate = ACTIVATE.replace(".venv/bin", str(VENV_BIN))
    ui = StackProcess.start("mlflow ui", ["bash", "-c", f"{activate} && exec "
                                          + ui_line.replace("--port 5000", f"--port {port}")],
                            log_path=tmp_path / "second.log", cwd=elsewhere, env=env)
    try:
        wait_until_up(f"http://127.0.0.1:{port}/health", ui, timeout_s=120)
        client = MlflowClient(f"http://127.0.0.1:{port}")
        assert client.get_run(tracker.run_id).info.status == "FINISHED"
        note = client.download_artifacts(tracker.run_id, "notes/hello.txt", str(tmp_path))
        assert Path(note).read_text() == "kept across the move"
        listed = {a.path for a in client.list_artifacts(tracker.run_id, "masks/step_0000000")}
        assert "masks/step_0000000/masks.npz" in listed
    finally:
        ui.stop()
