"""Issue 12 item 1: `csx serve` by hand (local Ray, as docs/service.md runs it "by hand")
keeps scheduling after its first jobs end, and a `kill -9` of it leaves no Ray process behind.
Issue 24 item 8: it logs through the MLflow UI it starts, so its store records no absolute
artifact path, and that UI goes with it too.

The bug: `ray.init` ran in a job's execution thread, and Ray ties gcs_server and raylet to the
thread that forked them, so they were defunct as soon as that job's thread ended and the server
exited a minute later. Here two jobs run in sequence; once the second one is done (the first
one's thread is long gone) no process under the server may be defunct, gcs_server and raylet
must be alive, and a third job must run to the end.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
from pathlib import Path

import httpx
import pytest

from service.local_stack import DEV_TOKEN_LINE
from service.processes import (StackProcess, descendants, free_port, parent_of, wait_for_line,
                               wait_until_up)
from service_helpers import kill_and_expect_nothing_left, processes_with_env, wait_for

TINY = {
    "train_input": {"batch_size": 2, "max_sequence_length": 8},
    "model": {"preset": "tiny"},
    "sparsity": {"algorithm": "static", "sparsity": 0.5},
    "runconfig": {"max_steps": 2, "log_steps": 1, "max_failures": 0},
}


def _start_serve(tmp_path: Path, *flags: str,
                 **env_extra: str) -> tuple[StackProcess, httpx.Client]:
    """`csx serve --dev-token FLAGS` on a free port with its state under tmp_path and its own
    local Ray (one system); returns it once healthz answers, with a client holding its token."""
    env = {**os.environ, "CSX_DATABASE_URL": f"sqlite:///{tmp_path / 'csx.db'}",
           "CSX_RUNS_DIR": str(tmp_path / "runs"), "CSX_CLUSTER_SIZE": "1",
           "CSX_MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "CSX_MLFLOW_UI_URL": f"http://127.0.0.1:{free_port()}",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env_extra}
    env.pop("RAY_ADDRESS", None)  # the by-hand path: the service runs its own local Ray
    port = free_port()
    server = StackProcess.start(
        "csx serve", [sys.executable, "-m", "service.cli", "serve", "--dev-token", *flags,
                      "--host", "127.0.0.1", "--port", str(port)],
        log_path=tmp_path / "serve.log", env=env, cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_up(f"{url}/v1/healthz", server, 120)
        token = wait_for_line(DEV_TOKEN_LINE, server, 30).group(1)
    except BaseException:
        server.stop()
        raise
    return server, httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"},
                                timeout=30)


def _state(pid: int) -> tuple[str, str] | None:
    """(command name, state letter) of a process, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, rest = text.split("(", 1)[1].rsplit(")", 1)
    return name, rest.split()[0]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_serve_runs_jobs_after_the_first_ones_end_and_leaves_nothing_when_killed(
        tmp_path: Path) -> None:
    server, http = _start_serve(tmp_path)
    try:
        def run_job() -> None:
            job_id = http.post("/v1/jobs", json={"params": TINY}).json()["id"]

            def finished() -> dict | None:
                server.check_alive()
                job = http.get(f"/v1/jobs/{job_id}").json()
                return job if job["status"] in ("SUCCEEDED", "FAILED", "CANCELLED") else None

            job = wait_for(finished, 600, f"job {job_id} to finish")  # a busy machine
            assert job["status"] == "SUCCEEDED", (job["status_message"], server.log_tail())

        run_job()
        run_job()
        # Ray's core processes, not defunct (other children come and go: a worker that just
        # exited may be a zombie for a moment).
        family = [_state(pid) for pid in descendants(server.popen.pid)]
        core = sorted(s for s in family if s and s[0] in ("gcs_server", "raylet"))
        assert [name for name, _ in core] == ["gcs_server", "raylet"], family
        assert all(state != "Z" for _, state in core), core
        run_job()
        assert http.get("/v1/healthz").json()["scheduler"] == "running"
        with sqlite3.connect(tmp_path / "mlflow.db") as db:
            uris = [row[0] for row in db.execute("select artifact_uri from runs")]
        assert len(uris) == 3 and all(uri.startswith("mlflow-artifacts:/") for uri in uris), uris
        assert (tmp_path / "mlartifacts").is_dir()

        # The Ray head watches the pipe from the server: everything it ran goes too, agents
        # (ray::DashboardAgent, ray::RuntimeEnvAgent) and workers included.
        kill_and_expect_nothing_left(server.popen, str(tmp_path), 90,
                                     "every process the killed server started to exit")
    finally:
        server.stop()


def test_serve_stops_on_sigterm_with_exit_code_0(tmp_path: Path) -> None:
    """A graceful stop is a success for process managers (compose, systemd)."""
    server, _ = _start_serve(tmp_path, "--no-mlflow-ui")
    try:
        server.popen.send_signal(signal.SIGTERM)
        assert server.popen.wait(60) == 0, server.log_tail()
    finally:
        server.stop()


@pytest.mark.timeout(900)
def test_serve_survives_losing_its_ray_head_and_resumes_the_job(tmp_path: Path) -> None:
    """Today's csx serve died a minute after its Ray head did (the driver loses the GCS and
    exits), and its job resumed only after a manual restart. Now csx serve restarts its API
    process, which starts a new head and resumes the job from its last checkpoint."""
    # Ray's 60 s without its GCS before a driver exits, shortened for the test.
    # One API process: csx serve's own restart is under test (with two, uvicorn restarts the
    # dead worker and the other one takes over the job).
    server, http = _start_serve(tmp_path, "--no-mlflow-ui", "--workers", "1",
                                RAY_gcs_rpc_server_reconnect_timeout_s="5")
    try:
        params = {**TINY, "runconfig": {**TINY.get("runconfig", {}), "max_steps": 100,
                                        "checkpoint_steps": 20, "log_steps": 5,
                                        "max_failures": 0}}
        job_id = http.post("/v1/jobs", json={"params": params}).json()["id"]

        def job() -> dict | None:
            try:
                return http.get(f"/v1/jobs/{job_id}").json()
            except httpx.TransportError:
                return None  # the API process is being restarted

        wait_for(lambda: ((job() or {}).get("progress") or {}).get("step", 0) > 25, 600,
                 "training past a checkpoint")
        gcs = [pid for pid in descendants(server.popen.pid) if _state(pid) and
               _state(pid)[0] in ("gcs_server", "raylet")]
        assert len(gcs) == 2, gcs
        for pid in gcs:
            os.kill(pid, signal.SIGKILL)
        done = wait_for(lambda: (j := job()) and j["status"] in ("SUCCEEDED", "FAILED") and j,
                        600, "the job to finish after the head was lost")
        assert done["status"] == "SUCCEEDED", (done["status_message"], server.log_tail())
        assert "restarting it" in server.log_tail(400)
        events = [e["to_status"] for e in http.get(f"/v1/jobs/{job_id}/events").json()["data"]]
        assert "RECOVERING" in events and "FAILED" not in events, events
    finally:
        server.stop()


def _api_workers(server: StackProcess) -> tuple[int, list[int]]:
    """(the API process, its uvicorn worker processes) under `csx serve`."""
    api = [pid for pid in descendants(server.popen.pid)
           if parent_of(pid) == server.popen.pid]
    assert len(api) == 1, api
    workers = [pid for pid in descendants(api[0])
               if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    return api[0], sorted(workers)


def test_serve_with_two_workers_answers_as_one_server(tmp_path: Path) -> None:
    """`csx serve --workers 2`: one worker schedules, the other stands by, and every
    connection meets the same server: its scheduler running, the dev token printed once
    valid, the failed-authentication budget shared (not doubled). A killed API process takes
    its workers along (they would hold the port), and a SIGTERM still exits 0."""
    server, http = _start_serve(tmp_path, "--no-mlflow-ui", "--workers", "2",
                                CSX_AUTH_FAILURES_MAX="4")
    try:
        api, workers = _api_workers(server)
        assert len(workers) == 2, workers
        url, token = str(http.base_url), http.headers["Authorization"]
        for _ in range(12):  # fresh connections: each may meet either worker
            with httpx.Client(base_url=url, timeout=30) as fresh:
                assert fresh.get("/v1/healthz").json()["scheduler"] == "running"
                assert fresh.get("/v1/jobs", headers={"Authorization": token}).status_code == 200
        answers = []
        for _ in range(8):
            with httpx.Client(base_url=url, timeout=30) as fresh:
                answers.append(fresh.get("/v1/jobs", headers={
                    "Authorization": "Bearer csx_wrong"}).status_code)
        assert 429 in answers and answers.index(429) <= 4, answers

        os.kill(api, signal.SIGKILL)
        wait_for(lambda: not any(_state(pid) for pid in workers), 60,
                 "the killed API process's workers to exit")

        def restarted() -> bool:
            try:
                with httpx.Client(base_url=url, timeout=30) as fresh:
                    return fresh.get("/v1/healthz").json()["scheduler"] == "running"
            except httpx.TransportError:
                return False  # between the old API process and the new one

        wait_for(restarted, 120, "the restarted API process to answer")
        assert _api_workers(server)[0] != api
        server.popen.send_signal(signal.SIGTERM)
        assert server.popen.wait(60) == 0, server.log_tail()
        wait_for(lambda: processes_with_env(str(tmp_path)) == [], 60,
                 "every process of the stopped server to exit")
    finally:
        server.stop()
