"""Helpers for the service tests: tokens, request bodies, polling, a scripted launcher.

`ScriptedLauncher` stands in for workers.runner.start_job in the fast tests: each launched job
blocks until the test finishes, fails or crashes it, so the scheduler's state machine can be
driven step by step. The end-to-end tests (restart, studies) use the real Ray runner.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from fastapi.testclient import TestClient

from service import crud
from service.db import make_engine, upgrade_database
from service.local_stack import StackProcess, descendants, free_port, wait_until_up
from service.models import Base

REPO_ROOT = Path(__file__).resolve().parents[2]


class ScriptedHandle:
    def __init__(self, job_kwargs: dict[str, Any]) -> None:
        self.kwargs = job_kwargs
        self.run_id = job_kwargs.get("mlflow_run_id")
        self.outcome: dict[str, Any] | BaseException | None = None
        self.cancelled = threading.Event()
        self._done = threading.Event()

    def finish(self, result: dict[str, Any] | BaseException) -> None:
        self.outcome = result
        self._done.set()

    def cancel(self) -> None:
        self.cancelled.set()
        self.finish(RuntimeError("job cancelled"))

    def wait(self) -> dict[str, Any]:
        self._done.wait(30)
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome or {}


class ScriptedLauncher:
    def __init__(self) -> None:
        self.handles: list[ScriptedHandle] = []  # in launch order
        self.create_runs = False  # like start_job: open an MLflow run when none is given

    def __call__(self, spec: Any, **kwargs: Any) -> ScriptedHandle:
        handle = ScriptedHandle(kwargs)
        if self.create_runs and handle.run_id is None:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(kwargs["tracking_uri"])
            experiment = client.get_experiment_by_name(kwargs["experiment"])
            experiment_id = (experiment.experiment_id if experiment
                             else client.create_experiment(kwargs["experiment"]))
            handle.run_id = client.create_run(experiment_id).info.run_id
        self.handles.append(handle)
        return handle

    def launches_of(self, job_id: int) -> list[ScriptedHandle]:
        return [h for h in self.handles if f"/job-{job_id}/" in h.kwargs["model_dir"]]

    def handle_for(self, job_id: int, *, launch: int = 1, timeout_s: float = 30) -> ScriptedHandle:
        """The handle of the job's `launch`-th launch, waiting for it to happen."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            mine = self.launches_of(job_id)
            if len(mine) >= launch:
                return mine[launch - 1]
            time.sleep(0.02)
        raise AssertionError(f"job {job_id} was not launched {launch} time(s)")


def make_token(client: TestClient, name: str, *, admin: bool = False) -> dict[str, str]:
    with client.app.state.sessionmaker() as session:
        _, secret = crud.create_token(session, name=name, is_admin=admin)
        session.commit()
    return {"Authorization": f"Bearer {secret}"}


def job_body(**options: Any) -> dict[str, Any]:
    """A small valid submission; `options` are top-level job options or params sections."""
    params = {"train_input": {"batch_size": 8, "seq_len": 16},
              "sparsity": {"algorithm": "rigl", "sparsity": 0.8, "update": {"freq": 5}},
              "runconfig": {"max_steps": 10}}
    for section in ("train_input", "eval_input", "model", "optimizer", "sparsity", "runconfig"):
        if section in options:
            params[section] = options.pop(section)
    return {"params": params, **options}


def wait_for(predicate: Callable[[], Any], timeout_s: float = 30, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def wait_status(client: TestClient, headers: dict[str, str], job_id: int, status: str,
                timeout_s: float = 30) -> dict[str, Any]:
    def current() -> dict[str, Any] | None:
        job = client.get(f"/v1/jobs/{job_id}", headers=headers).json()
        return job if job["status"] == status else None

    return wait_for(current, timeout_s, f"job {job_id} to reach {status}")


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class ServerProcess:
    """`uvicorn service.main:app` on 127.0.0.1 in a subprocess, with CSX_* settings in env."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.env, self.cwd = env, cwd
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 90) -> None:
        # Its own process group (StackProcess): Ray's agents stay in it.
        server = StackProcess.start(
            "uvicorn", [sys.executable, "-m", "uvicorn", "service.main:app", "--host",
                        "127.0.0.1", "--port", str(self.port), "--log-level", "warning"],
            log_path=self.cwd / f"uvicorn-{self.port}-{time.monotonic_ns()}.log",
            env=self.env, cwd=REPO_ROOT)
        self.process = server.popen
        wait_until_up(f"{self.url}/v1/healthz", server, timeout_s)

    def kill_hard(self) -> list[int]:
        """SIGKILL the server and every process it started (Ray included), as a crash would."""
        assert self.process is not None
        victims = [self.process.pid, *descendants(self.process.pid)]
        _kill_all(victims, self.process.pid)
        self.process.wait(10)
        return victims

    def stop(self) -> None:
        """Graceful stop, then make sure nothing it started is left behind."""
        if self.process is None or self.process.poll() is not None:
            return
        survivors = descendants(self.process.pid)
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        _kill_all(survivors, self.process.pid)


def _kill_all(pids: list[int], group: int) -> None:
    """SIGKILL `pids` (Ray workers run in process groups of their own) and process group
    `group` (orphaned Ray agents are reparented away but stay in it)."""
    for pid in pids:
        if is_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def assert_schema_matches_models(url: str) -> None:
    upgrade_database(url)
    engine = make_engine(url)
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
        assert diff == [], diff
        assert set(inspect(connection).get_table_names()) >= {
            "jobs", "job_events", "studies", "tokens", "idempotency_keys", "alembic_version"}
    engine.dispose()
