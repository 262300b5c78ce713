"""Restart safety with a real stop and a real crash, mid-training: SIGTERM the uvicorn process
(it exits 0 and leaves the job resumable, not FAILED), then, after it resumed, SIGKILL it and the
Ray runtime it started; each restarted service resumes the job from its last checkpoint as
RECOVERING, runs it once to the end, and keeps queued jobs queued."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service_helpers import REPO_ROOT, ServerProcess, is_alive, processes_with_env, wait_for

MAX_STEPS = 300
CHECKPOINT_STEPS = 20
PARAMS = {
    "train_input": {"batch_size": 4, "max_sequence_length": 16},
    "eval_input": {"batch_size": 4, "max_sequence_length": 16},
    "model": {"preset": "tiny"},
    "sparsity": {"algorithm": "static", "sparsity": 0.5},
    "runconfig": {"max_steps": MAX_STEPS, "checkpoint_steps": CHECKPOINT_STEPS, "log_steps": 5,
                  "eval_steps": 1, "max_failures": 0},
}


def _get(server: ServerProcess, token: str, path: str) -> httpx.Response:
    return httpx.get(server.url + path, headers={"Authorization": f"Bearer {token}"}, timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # deadlines below are for a busy machine
def test_kill_mid_training_then_resume_once(tmp_path: Path) -> None:
    env = {**os.environ, "CSX_DATABASE_URL": f"sqlite:///{tmp_path / 'csx.db'}",
           "CSX_RUNS_DIR": str(tmp_path / "runs"), "CSX_CLUSTER_SIZE": "1",
           "CSX_MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    token = subprocess.run([sys.executable, "-m", "service.cli", "token", "create", "--name", "r"],
                           env=env, cwd=REPO_ROOT, check=True, capture_output=True,
                           text=True).stdout.strip().splitlines()[-1]
    auth = {"Authorization": f"Bearer {token}"}
    server = ServerProcess(env, tmp_path)
    server.start()
    try:
        running = httpx.post(server.url + "/v1/jobs", json={"params": PARAMS}, headers=auth,
                             timeout=30).json()["id"]
        waiting = httpx.post(server.url + "/v1/jobs", json={"params": PARAMS}, headers=auth,
                             timeout=30).json()["id"]

        def past_checkpoint(after: int) -> int | None:
            job = _get(server, token, f"/v1/jobs/{running}").json()
            assert job["status"] not in ("FAILED", "SUCCEEDED"), job
            step = (job["progress"] or {}).get("step", 0)
            # RUNNING: a resumed job shows its old progress while it is RECOVERING
            return step if job["status"] == "RUNNING" and step > after + CHECKPOINT_STEPS else None

        stopped_at = wait_for(lambda: past_checkpoint(0), 600, "training past a checkpoint")
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        # uvicorn re-raises SIGTERM after its graceful shutdown (csx serve exits 0 instead:
        # test_service_serve); what must not happen is Ray's abort (-6) on the way.
        assert server.process.wait(180) in (0, -signal.SIGTERM), "SIGTERM must stop it cleanly"
        with sqlite3.connect(tmp_path / "csx.db") as db:
            left, progress = db.execute("SELECT status, progress FROM jobs WHERE id = ?",
                                        (running,)).fetchone()
            moves = [row[0] for row in db.execute(
                "SELECT to_status FROM job_events WHERE job_id = ? ORDER BY id", (running,))]
        assert left == "RUNNING" and "FAILED" not in moves, (left, moves)
        # The job trains on while the server drains: where it was when it stopped
        stopped_at = max(stopped_at, json.loads(progress or "{}").get("step", 0))
        server.stop()

        server.start()
        killed_at = wait_for(lambda: past_checkpoint(stopped_at), 600,
                             "the resumed job past another checkpoint")
        victims = server.kill_hard()
        assert killed_at < MAX_STEPS
        wait_for(lambda: not any(is_alive(p) for p in victims), 20, "the crashed processes to die")

        server.start()
        job = _get(server, token, f"/v1/jobs/{running}").json()
        assert job["status"] in ("RECOVERING", "RUNNING"), job
        assert _get(server, token, f"/v1/jobs/{waiting}").json()["status"] == "QUEUED"
        done = wait_for(lambda: (j := _get(server, token, f"/v1/jobs/{running}").json())["status"]
                        in ("SUCCEEDED", "FAILED") and j, 600, "the resumed job to finish")
        assert done["status"] == "SUCCEEDED", done["status_message"]
        assert done["attempt"] == 1 and done["result"]["steps"] == MAX_STEPS

        events = [e["to_status"] for e in _get(server, token, f"/v1/jobs/{running}/events")
                  .json()["data"]]
        assert events == ["QUEUED", "VALIDATING", "PROVISIONING", "RUNNING", "RECOVERING",
                          "RUNNING", "RECOVERING", "RUNNING", "SUCCEEDED"]
        log = _get(server, token, f"/v1/jobs/{running}/logs").text
        assert "the job resumes from its last checkpoint at the next start" in log
        restarts = log.split("resuming (service restarted)")
        assert len(restarts) == 3
        for after, interrupted_at in zip(restarts[1:], (stopped_at, killed_at)):
            steps = [json.loads(line.split(" ", 1)[1])["step"] for line in after.splitlines()
                     if '"step"' in line and line.split(" ", 1)[1].startswith("{")]
            # Resumed from the checkpoint before the interruption, not from scratch, and never
            # past the end.
            assert steps and steps[0] >= interrupted_at - CHECKPOINT_STEPS
            assert steps == sorted(steps) and steps[-1] <= MAX_STEPS
        # The second job then gets the single system.
        wait_for(lambda: _get(server, token, f"/v1/jobs/{waiting}").json()["status"] != "QUEUED",
                 180, "the queued job to start")
    finally:
        server.stop()
    # Nothing either server started is left: the crash's Ray head included.
    wait_for(lambda: processes_with_env(str(tmp_path)) == [], 120,
             "every process of both servers to exit")
