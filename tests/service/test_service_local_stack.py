"""`csx local-study` (service/local_stack.py): the stack `make run` starts, on a tiny study."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import sys
from pathlib import Path

import pytest
import yaml

from service.local_stack import LocalStack, format_report, progress_line, run_local_study
from service.processes import (
    RAY_WORKER_PORTS,
    StackError,
    StackProcess,
    descendants,
    free_port,
    wait_for_line,
)
from service.supervised import MlflowUI, RayHead
from service_helpers import (
    REPO_ROOT,
    kill_and_expect_nothing_left,
    process_name,
    processes_with_env,
    wait_for,
)

TINY_STUDY = {
    "name": "tiny-study", "algorithms": ["dense", "rigl"], "sparsity": 0.8,
    "train_input": {"data_dir": "builtin:shakespeare", "batch_size": 4, "max_sequence_length": 16},
    "eval_input": {"batch_size": 4, "max_sequence_length": 16},
    "model": {"preset": "tiny", "tokenizer": "byte"},
    "runconfig": {"max_steps": 6, "eval_frequency": 3, "eval_steps": 1, "log_steps": 2,
                  "seed": 0, "num_csx": 2},
}


@pytest.mark.slow
def test_local_study_reports_every_variant_and_stops_what_it_started(tmp_path):
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump(TINY_STUDY))
    state = tmp_path / "state"
    out = io.StringIO()

    code = run_local_study(study, state_dir=state, keep_ui=False, out=out)

    text = out.getvalue()
    assert code == 0, text
    assert "2 variants submitted" in text
    for variant in ("dense", "rigl"):
        assert any(line.split()[:2] == [variant, "SUCCEEDED"] for line in text.splitlines()), text
    assert "step     6/6" in text  # a progress line with the job's step
    assert "MLflow UI: http://127.0.0.1:" in text
    assert list(state.glob("study-*-perplexity.png"))
    assert processes_with_env(str(state.resolve())) == []  # Ray included


def test_taken_port_is_a_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is taken"):
            LocalStack(tmp_path, api_port=port).start()


def test_dead_process_error_carries_its_log_tail(tmp_path):
    process = StackProcess.start(
        "doomed", [sys.executable, "-c", "print('boom', flush=True); raise SystemExit(3)"],
        log_path=tmp_path / "doomed.log", env={}, cwd=tmp_path)
    process.popen.wait(30)
    with pytest.raises(StackError, match=r"doomed exited with code 3(.|\n)*boom"):
        process.check_alive()
    process.stop()


def test_stop_returns_once_every_killed_process_has_exited(tmp_path):
    """Issue 12 item 6: stop() sent SIGKILL and returned at once, so on a busy machine a
    grandchild was often still alive when the caller looked (`assert [5075] == []`). Eight
    grandchildren in sessions of their own, each ignoring SIGTERM, widen that window; stop()
    must not return before all of them are gone."""
    ignore_term = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, "
                   "signal.SIG_IGN); [subprocess.Popen([sys.executable, '-c', "
                   "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "time.sleep(60)'], start_new_session=True) for _ in range(8)]; "
                   "print('up', flush=True); time.sleep(60)")
    process = StackProcess.start("stubborn", [sys.executable, "-c", ignore_term],
                                 log_path=tmp_path / "s.log", env={"MARK": str(tmp_path)},
                                 cwd=tmp_path)
    wait_for_line(re.compile("up"), process, 60)
    assert len(processes_with_env(str(tmp_path))) == 9
    process.stop(grace_s=0.5)
    assert processes_with_env(str(tmp_path)) == []  # at once: no polling here


def test_progress_line_and_report_table():
    job = {"name": "s/rigl", "tags": {"csx.variant": "rigl"}, "status": "RUNNING",
           "progress": {"step": 50, "max_steps": 1000, "loss": 2.5, "tokens_per_s": 1234.0},
           "status_message": None}
    assert progress_line(job, 12.0) == (
        "[    12s] rigl     RUNNING      step    50/1000  loss 2.500  1,234 tok/s")
    table = format_report([
        {"variant": "dense", "status": "SUCCEEDED", "final_eval_perplexity": 6.0812,
         "best_eval_perplexity": 6.0, "projected_speedup": 1.0, "wall_time_s": 61.2},
        {"variant": "set", "status": "FAILED", "final_eval_perplexity": None,
         "best_eval_perplexity": None, "projected_speedup": None, "wall_time_s": None}])
    lines = table.splitlines()
    assert lines[2].split() == ["dense", "SUCCEEDED", "6.081", "6.000", "1.00×", "61"]
    assert lines[3].split() == ["set", "FAILED", "—", "—", "—", "—"]


def test_reference_study_yaml_is_the_issue_study():
    from service.api.body import nest_params
    from service.schemas import StudyCreate
    from service.studies import variants

    body = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "study.yaml")
                          .read_text())
    study = StudyCreate.model_validate(nest_params(body, StudyCreate))
    sections = dict(variants(study))
    assert list(sections) == ["dense", "static", "set", "rigl", "granet"]
    assert sections["dense"] is None
    assert {sections[a]["sparsity"] for a in ("static", "set", "rigl", "granet")} == {0.8}
    assert sections["granet"]["init_sparsity"] == 0.5
    assert study.params.runconfig.num_csx == 2
    assert study.params.train_input.data_dir == "builtin:shakespeare"


def test_die_with_parent_child_stops_when_its_parent_is_sigkilled(tmp_path):
    """A child in a session of its own survives its parent's SIGKILL unless it dies with it."""
    parent = ("import sys, time; from pathlib import Path; "
              "from service.processes import StackProcess; "
              "StackProcess.start('sleeper', [sys.executable, '-c', 'import time; time.sleep(120)'],"
              " log_path=Path(sys.argv[1]), env={'MARK': sys.argv[2]}, cwd=Path(sys.argv[2]),"
              " die_with_parent=sys.argv[3] == 'yes'); print('up', flush=True); time.sleep(120)")
    for dies in ("no", "yes"):
        spawner = StackProcess.start(
            "spawner", [sys.executable, "-c", parent, str(tmp_path / f"{dies}.log"),
                        str(tmp_path), dies],
            log_path=tmp_path / "spawner.log", env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            cwd=tmp_path)
        wait_for_line(re.compile("up"), spawner, 60)
        [child] = processes_with_env(str(tmp_path))
        os.kill(spawner.popen.pid, signal.SIGKILL)
        spawner.popen.wait(30)
        if dies == "yes":
            wait_for(lambda: processes_with_env(str(tmp_path)) == [], 60, "the child to die")
        else:
            assert processes_with_env(str(tmp_path)) == [child]  # the leak this option closes
            os.kill(child, signal.SIGKILL)
            wait_for(lambda: processes_with_env(str(tmp_path)) == [], 60, "the child to die")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_head_stops_ray_when_its_watcher_is_killed(tmp_path, monkeypatch):
    """Issue 12: SIGKILL of the `service.supervised` watcher (a crash that takes the server's
    whole family) orphaned `ray start --head --block`, which lives in a session of its own."""
    monkeypatch.setenv("CSX_TEST_STATE", str(tmp_path))
    monkeypatch.chdir(REPO_ROOT)
    head = RayHead(systems=1, log_path=tmp_path / "ray" / "head.log",
                   worker_ports=RAY_WORKER_PORTS, start_timeout_s=240)
    try:
        names = {pid: process_name(pid) for pid in processes_with_env(str(tmp_path))}
        assert {"gcs_server", "raylet"} <= set(names.values()), names
        # Its workers bind the service's range, not Ray's default 10002-19999 (issue 32).
        raylet = next(pid for pid, name in names.items() if name == "raylet")
        argv = Path(f"/proc/{raylet}/cmdline").read_bytes().decode().split("\0")
        low, high = RAY_WORKER_PORTS
        assert {f"--min_worker_port={low}", f"--max_worker_port={high}"} <= set(argv), argv
        kill_and_expect_nothing_left(head.popen, str(tmp_path), 180,
                                     "every Ray process to exit after its watcher was killed")
    finally:
        head.close()
        for pid in processes_with_env(str(tmp_path)):  # a regression must not leak into the suite
            os.kill(pid, signal.SIGKILL)


def test_mlflow_ui_of_csx_serve_refuses_an_address_it_cannot_serve(tmp_path):
    """Before anything starts: a UI address off 127.0.0.1, without a port, or on a taken port
    is a ValueError naming the setting or the port (the CLI prints it without a traceback)."""
    for url in ("https://127.0.0.1:5000", "http://0.0.0.0:5000", "http://127.0.0.1"):
        with pytest.raises(ValueError, match="CSX_MLFLOW_UI_URL"):
            MlflowUI(store=tmp_path / "mlflow.db", url=url, log_path=tmp_path / "ui.log")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is taken"):
            MlflowUI(store=tmp_path / "mlflow.db", url=f"http://127.0.0.1:{port}",
                     log_path=tmp_path / "ui.log")
    assert not (tmp_path / "ui.log").exists()  # nothing was started


def test_mlflow_ui_that_dies_is_restarted_on_its_port(tmp_path):
    """Today's UI, killed, stayed dead: the running job hung and every new one failed after
    minutes of retries. Its watcher now kills what the dead server left (a worker holding the
    port) and starts it again on the same address, keeping the old log beside the new one."""
    import httpx

    port = free_port()
    ui = MlflowUI(store=tmp_path / "mlflow.db", url=f"http://127.0.0.1:{port}",
                  log_path=tmp_path / "ui.log")
    try:
        first = next(pid for pid in descendants(ui.popen.pid)  # `mlflow ui`, the watcher's child
                     if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
                     == str(ui.popen.pid))
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: (tmp_path / "ui.log.1").exists(), 60, "the watcher to notice")
        wait_for(lambda: _answers(httpx, f"{ui.url}/health"), 180, "the UI to come back")
        assert first not in descendants(ui.popen.pid)
        assert ui.popen.poll() is None, "the watcher itself keeps running"
    finally:
        ui.close()


def _answers(httpx, url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False
