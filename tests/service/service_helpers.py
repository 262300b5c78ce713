"""Helpers for the service tests: tokens, request bodies, polling, a scripted launcher, and
the processes of the end-to-end tests (uvicorn, a private PostgreSQL server).

`ScriptedLauncher` stands in for workers.runner.start_job in the fast tests: each launched job
blocks until the test finishes, fails or crashes it, so the scheduler's state machine can be
driven step by step. The end-to-end tests (restart, studies, topology) use the real Ray runner.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from fastapi.testclient import TestClient

from service import crud, joblogs
from service.db import make_engine, upgrade_database
from service.processes import StackProcess, descendants, free_port, wait_until_up
from service.models import Base, Job

REPO_ROOT = Path(__file__).resolve().parents[2]
PG_SCRIPT = Path(__file__).with_name("pg.sh")


class ScriptedHandle:
    def __init__(self, plan: Any, job_kwargs: dict[str, Any]) -> None:
        self.plan = plan  # training.plan.JobPlan: what the scheduler admitted
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
        # No timeout: a job the test leaves running stays RUNNING (a timeout here once turned
        # slow tests' jobs into surprise successes); its thread is a daemon.
        self._done.wait()
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome or {}


class ScriptedLauncher:
    def __init__(self) -> None:
        self.handles: list[ScriptedHandle] = []  # in launch order
        self.create_runs = False  # like start_job: open an MLflow run when none is given

    def __call__(self, plan: Any, **kwargs: Any) -> ScriptedHandle:
        handle = ScriptedHandle(plan, kwargs)
        if self.create_runs and handle.run_id is None:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(kwargs["tracking_uri"])
            handle.run_id = client.create_run(kwargs["experiment_id"], run_name=kwargs["run_name"],
                                              tags=kwargs["tags"]).info.run_id
        self.handles.append(handle)
        return handle

    def launches_of(self, job_id: int) -> list[ScriptedHandle]:
        folders = (f"job-{job_id}", f"job-{job_id}-")  # a job from before run keys: job-<id>
        return [h for h in self.handles
                if Path(h.kwargs["model_dir"]).parent.name in folders[:1]
                or Path(h.kwargs["model_dir"]).parent.name.startswith(folders[1])]

    def handle_for(self, job_id: int, *, launch: int = 1, timeout_s: float = 30) -> ScriptedHandle:
        """The handle of the job's `launch`-th launch, waiting for it to happen."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            mine = self.launches_of(job_id)
            if len(mine) >= launch:
                return mine[launch - 1]
            time.sleep(0.02)
        raise AssertionError(f"job {job_id} was not launched {launch} time(s)")


def start_auth_mlflow(state: Path, admin: tuple[str, str]) -> tuple[StackProcess, str]:
    """`mlflow server --app-name basic-auth` keeping its stores in `state`, with `admin` as its
    admin account and nothing allowed by default (service/mlflow_auth.py): (process, url)."""
    from service.mlflow_auth import CREDENTIALS_ENV, MlflowAccess, server_env

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **server_env(MlflowAccess(url, *admin), state),
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    for name in CREDENTIALS_ENV:
        env.pop(name, None)
    server = StackProcess.start("mlflow server", [
        sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth", "--host",
        "127.0.0.1", "--port", str(port), "--workers", "1", "--backend-store-uri",
        f"sqlite:///{state / 'mlflow.db'}", "--serve-artifacts", "--artifacts-destination",
        str(state / "mlartifacts")], log_path=state / "mlflow.log", env=env, cwd=state)
    try:
        wait_until_up(f"{url}/health", server, 180)
    except BaseException:
        server.stop()
        raise
    return server, url


def make_token(client: TestClient, name: str, *, admin: bool = False) -> dict[str, str]:
    with client.app.state.sessionmaker() as session:
        _, secret = crud.create_token(session, name=name, is_admin=admin)
        session.commit()
    return {"Authorization": f"Bearer {secret}"}


def job_folder(client: TestClient, runs_dir: Path, job_id: int) -> Path:
    """The job's folder under runs_dir (its name holds the job's run key)."""
    with client.app.state.sessionmaker() as session:
        return joblogs.job_dir(runs_dir, job_id, session.get(Job, job_id).run_key)


def job_body(**options: Any) -> dict[str, Any]:
    """A small valid submission; `options` are top-level job options or params sections."""
    params = {"train_input": {"batch_size": 8, "max_sequence_length": 16},
              "model": {"preset": "tiny"},
              "sparsity": {"algorithm": "rigl", "sparsity": 0.8, "update": {"freq": 5}},
              "runconfig": {"max_steps": 10}}
    for section in ("train_input", "eval_input", "model", "optimizer", "sparsity", "runconfig"):
        if section in options:
            params[section] = options.pop(section)
    return {"params": params, **options}


def health_latencies_during(url: str, attack_round: Callable[[int], None], *, attackers: int = 1,
                            min_rounds: int = 2, max_rounds: int = 20,
                            min_checks: int = 20) -> list[float]:
    """Seconds each /v1/healthz took while `attackers` threads ran `attack_round(i)`: each at
    least `min_rounds` times, then on until health was checked `min_checks` times (a server
    that refuses fast must not end the attack before it was judged), `max_rounds` at most."""
    import httpx

    enough_checks = threading.Event()

    def attack(i: int) -> None:
        for round_ in range(max_rounds):
            if round_ >= min_rounds and enough_checks.is_set():
                return
            attack_round(i)

    threads = [threading.Thread(target=attack, args=(i,)) for i in range(attackers)]
    latencies: list[float] = []
    with httpx.Client(base_url=url, timeout=30) as http:
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            started = time.perf_counter()
            assert http.get("/v1/healthz").status_code == 200
            latencies.append(time.perf_counter() - started)
            if len(latencies) >= min_checks:
                enough_checks.set()
            time.sleep(0.02)
    for thread in threads:
        thread.join()
    return latencies


def wait_for(predicate: Callable[[], Any], timeout_s: float = 30, what: str = "condition") -> Any:
    # The pause grows from 20 ms to 0.5 s: quick answers stay quick, and a long wait does not
    # poll the API fifty times a second, taking CPU from the jobs it waits for on a busy machine.
    deadline, pause = time.monotonic() + timeout_s, 0.02
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(pause)
        pause = min(pause * 1.5, 0.5)
    raise AssertionError(f"timed out waiting for {what}")


def wait_status(client: TestClient, headers: dict[str, str], job_id: int, status: str,
                timeout_s: float = 30) -> dict[str, Any]:
    def current() -> dict[str, Any] | None:
        job = client.get(f"/v1/jobs/{job_id}", headers=headers).json()
        return job if job["status"] == status else None

    return wait_for(current, timeout_s, f"job {job_id} to reach {status}")


def process_name(pid: int) -> str | None:
    """A process's command name; None once it is gone (it may exit between listing and reading)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


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
        self.server: StackProcess | None = None

    def start(self, timeout_s: float = 90) -> None:
        # Its own process group (StackProcess): Ray's agents stay in it.
        self.server = StackProcess.start(
            "uvicorn", [sys.executable, "-m", "uvicorn", "service.main:app", "--host",
                        "127.0.0.1", "--port", str(self.port), "--log-level", "warning"],
            log_path=self.cwd / f"uvicorn-{self.port}-{time.monotonic_ns()}.log",
            env=self.env, cwd=REPO_ROOT)
        self.process = self.server.popen
        wait_until_up(f"{self.url}/v1/healthz", self.server, timeout_s)

    def kill_hard(self) -> list[int]:
        """SIGKILL the server and every process it started (Ray included), as a crash would."""
        assert self.process is not None
        victims = [self.process.pid, *descendants(self.process.pid)]
        _kill_all(victims, self.process.pid)
        self.process.wait(10)
        return victims

    def stop(self) -> None:
        """Graceful stop, then SIGKILL for whatever it started, waiting until all are gone."""
        if self.server is not None and self.server.popen.poll() is None:
            self.server.stop(grace_s=30)


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


def processes_with_env(text: str) -> list[int]:
    """Living processes whose environment mentions `text` (a test's own state folder): what a
    stack started and failed to stop, whatever process group or session it moved to."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if text.encode() in environ.read_bytes() and is_alive(int(environ.parent.name)):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def kill_and_expect_nothing_left(popen: subprocess.Popen, marker: str, timeout_s: float,
                                 what: str) -> None:
    """SIGKILL `popen` alone, as a crash would, then wait until no process whose environment
    mentions `marker` is left: what it started must go with it."""
    os.kill(popen.pid, signal.SIGKILL)
    popen.wait(30)
    wait_for(lambda: processes_with_env(marker) == [], timeout_s, what)


def listening_sockets(pids: Iterable[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that one of `pids` holds (/proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
        except OSError:
            continue  # exited meanwhile
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            ip = ipaddress.ip_address(raw)
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped
            found.add((str(ip), int(port, 16)))
    return found


@dataclass
class PostgresServer:
    """A private PostgreSQL server on 127.0.0.1 (initdb + pg_ctl, trust auth, superuser
    `postgres`), its socket and data in a temporary folder; tests/service/pg.sh installs the
    Debian package when the binaries are missing."""

    bin_dir: Path
    data_dir: Path
    port: int
    as_user: list[str]  # initdb refuses to run as root, so root runs it as user postgres

    @classmethod
    def start(cls) -> PostgresServer:
        found = subprocess.run(["bash", str(PG_SCRIPT)], capture_output=True, text=True)
        if found.returncode != 0:
            raise RuntimeError(f"PostgreSQL is required for this test and could not be "
                               f"installed: {found.stderr.strip()}")
        as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        data = Path(tempfile.mkdtemp(prefix="csx-pg-"))
        if as_user:
            user = pwd.getpwnam("postgres")
            os.chown(data, user.pw_uid, user.pw_gid)
        server = cls(Path(found.stdout.strip().splitlines()[-1]), data, free_port(), as_user)
        try:
            server._run("initdb", "-D", str(data / "db"), "-U", "postgres", "--auth=trust",
                        "-E", "UTF8")
            server.start_server()
        except BaseException:
            shutil.rmtree(data, ignore_errors=True)
            raise
        return server

    def url(self, database: str = "postgres") -> str:
        """The URL as docker-compose.yml writes it (Settings picks the psycopg 3 driver)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """`createdb` over TCP on 127.0.0.1, like docker/postgres-init.sql's CREATE DATABASE."""
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name)
        return self.url(name)

    def is_ready(self, database: str = "postgres") -> bool:
        """What the compose api service polls before migrating: `pg_isready`."""
        ready = subprocess.run([str(self.bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p",
                                str(self.port), "-U", "postgres", "-d", database],
                               capture_output=True)
        return ready.returncode == 0

    def pid(self) -> int:
        """The postmaster's process id (first line of postmaster.pid)."""
        return int((self.data_dir / "db" / "postmaster.pid").read_text().split()[0])

    def stop_server(self) -> None:
        """An outage: the server goes (its data stays) until `start_server`."""
        self._run("pg_ctl", "-D", str(self.data_dir / "db"), "-m", "fast", "-w", "stop")

    def start_server(self) -> None:
        self._run("pg_ctl", "-D", str(self.data_dir / "db"), "-w", "-l",
                  str(self.data_dir / "log"), "-o",
                  f"-p {self.port} -k {self.data_dir} -c listen_addresses=127.0.0.1", "start")

    def stop(self) -> None:
        subprocess.run([*self.as_user, str(self.bin_dir / "pg_ctl"), "-D",
                        str(self.data_dir / "db"), "-m", "fast", "-w", "stop"],
                       capture_output=True)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run([*self.as_user, str(self.bin_dir / tool), *args],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr.strip()}")
