"""docker-compose.yml's topology as plain processes on one host (there is no Docker engine here).

PostgreSQL (one private server, databases for the service, MLflow and MLflow's users), `mlflow
server --app-name basic-auth` on the `mlflow` database with a local artifact folder and the
compose file's auth config (nothing allowed by default; the service is its admin), `ray start --head`, and the API as the
compose `api` service runs it: `pg_isready`, `alembic upgrade head`, then `uvicorn`. Every
process gets the environment the compose file gives its service, with local addresses. A
two-variant study (dense, rigl; num_csx 2: two Ray actors and a gloo all-reduce per job) goes
in over HTTP; the test then reads the database rows and the MLflow runs over MLflow's REST API
(as the admin; anonymous reads are refused).

Everything listens on 127.0.0.1 only, which the test checks, except Ray: 2.60 rewrites a
127.0.0.1 node address to the routable one and binds its gRPC servers to every interface.
Every process is stopped by its own StackProcess (process groups plus recorded descendants:
gcs_server ignores SIGTERM); never `ray stop`, which kills every Ray process on the machine.
"""

from __future__ import annotations

import configparser
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sqlalchemy import select

from service import crud
from service.db import make_engine, make_sessionmaker
from service.main import WORKER_HEALTHCHECK_S
from service.processes import (
    HOST,
    RAY_STARTED,
    StackProcess,
    descendants,
    free_port,
    wait_for_line,
    wait_until_up,
)
from service.models import Job, JobEvent, Study
from service.settings import Settings
from service_helpers import (
    REPO_ROOT,
    PostgresServer,
    listening_sockets,
    processes_with_env,
    wait_for,
)

COMPOSE = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
EXPERIMENT = "topology-study"
VARIANTS = ["dense", "rigl"]
STUDY = {
    "name": "topology", "experiment": EXPERIMENT, "algorithms": VARIANTS, "sparsity": 0.8,
    "params": {
        "train_input": {"data_dir": "builtin:shakespeare", "batch_size": 4, "max_sequence_length": 16},
        "eval_input": {"batch_size": 4, "max_sequence_length": 16},
        "model": {"preset": "tiny", "tokenizer": "byte"},
        "runconfig": {"max_steps": 4, "eval_steps": 1, "log_steps": 2, "seed": 0,
                      "num_csx": 2},
    },
}
# docs/design.md §4: the path of a job that runs to the end, first event written on submission.
SUCCESS_PATH = [(None, "QUEUED"), ("QUEUED", "VALIDATING"), ("VALIDATING", "PROVISIONING"),
                ("PROVISIONING", "RUNNING"), ("RUNNING", "SUCCEEDED")]
SYSTEMS = 4  # the compose file's ray-worker replicas, one csx each: both variants fit at once
START_TIMEOUT_S = 240  # deadlines for a busy machine; idle runs take a fraction
STUDY_TIMEOUT_S = 900
ADMIN = "csx-service"  # the compose file's default CSX_MLFLOW_ADMIN_USERNAME
TOKEN_NAME = "topology"


def compose_environment(service: str) -> dict[str, str]:
    """A compose service's `environment` (anchors and merge keys resolved by yaml)."""
    return {key: str(value) for key, value in COMPOSE["services"][service]["environment"].items()}


@dataclass
class Topology:
    """The running processes and their local addresses."""

    state_dir: Path
    database_url: str = ""
    mlflow_url: str = ""
    api_url: str = ""
    ray_address: str = ""
    artifacts_dir: Path = Path()
    ray_temp_dir: Path | None = None
    token: str = ""
    admin_password: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    auth_config: Path = Path()
    processes: list[StackProcess] = field(default_factory=list)

    def api_environment(self) -> dict[str, str]:
        """docker-compose.yml's x-csx-env and api overrides, with addresses on 127.0.0.1."""
        return {
            "CSX_DATABASE_URL": self.database_url,
            "CSX_MLFLOW_TRACKING_URI": self.mlflow_url,
            "CSX_MLFLOW_UI_URL": self.mlflow_url,
            "CSX_RUNS_DIR": str(self.state_dir / "runs"),
            "RAY_ADDRESS": self.ray_address,
            "RAY_AUTH_MODE": "disabled",
            "MLFLOW_TRACKING_URI": self.mlflow_url,
            "CSX_RUN_MIGRATIONS_ON_START": "false",
            "CSX_API_WORKERS": compose_environment("api")["CSX_API_WORKERS"],
            "CSX_MLFLOW_ADMIN_USERNAME": ADMIN,
            "CSX_MLFLOW_ADMIN_PASSWORD": self.admin_password,
        }

    def mlflow_environment(self) -> dict[str, str]:
        """docker-compose.yml's mlflow environment, with a local auth config."""
        return {
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "MLFLOW_AUTH_CONFIG_PATH": str(self.auth_config),
            "MLFLOW_AUTH_ADMIN_USERNAME": ADMIN,
            "MLFLOW_AUTH_ADMIN_PASSWORD": self.admin_password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
        }

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> StackProcess:
        # CSX_TOPOLOGY_TEST marks every process of the stack, whatever group it moves to.
        process = StackProcess.start(
            name, argv, log_path=self.state_dir / "logs" / f"{name}.log", cwd=REPO_ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "CSX_TOPOLOGY_TEST": str(self.state_dir),
                 **env})
        self.processes.append(process)
        return process

    def process(self, name: str) -> StackProcess:
        return next(process for process in self.processes if process.name == name)

    def check_alive(self) -> None:
        for process in self.processes:
            process.check_alive()

    def stop(self) -> None:
        # Reverse start order: the API ends its jobs and leaves Ray before Ray goes.
        while self.processes:
            self.processes.pop().stop()
        if self.ray_temp_dir is not None:
            shutil.rmtree(self.ray_temp_dir, ignore_errors=True)


def start_topology(topology: Topology, postgres: PostgresServer) -> None:
    state = topology.state_dir
    # Two databases on one server, as docker/postgres-init.sql does.
    topology.database_url = postgres.create_database("csx")
    mlflow_store = postgres.create_database("mlflow")
    # docker/mlflow-auth.ini with the users' database on this server.
    auth = configparser.ConfigParser()
    auth.read(REPO_ROOT / "docker" / "mlflow-auth.ini")
    auth["mlflow"]["database_uri"] = postgres.create_database("mlflow_auth").replace(
        "postgresql://", "postgresql+psycopg://")
    topology.auth_config = state / "mlflow-auth.ini"
    with topology.auth_config.open("w") as out:
        auth.write(out)
    mlflow_port, ray_port, api_port = free_port(), free_port(), free_port()
    topology.mlflow_url = f"http://{HOST}:{mlflow_port}"
    topology.ray_address = f"{HOST}:{ray_port}"
    topology.api_url = f"http://{HOST}:{api_port}"
    topology.artifacts_dir = state / "mlartifacts"
    env = topology.api_environment()

    # mlflow: as the compose service, on the project's MLflow and its psycopg 3 driver.
    mlflow = topology.start("mlflow", [
        sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth",
        "--host", HOST, "--port", str(mlflow_port),
        "--workers", "1", "--backend-store-uri",
        mlflow_store.replace("postgresql://", "postgresql+psycopg://"),
        "--artifacts-destination", str(topology.artifacts_dir), "--serve-artifacts"],
        topology.mlflow_environment())
    # ray-head: one node holds the CPUs compose spreads over ray-worker replicas. Free ports for
    # what would otherwise take fixed defaults, and a short private temp dir (socket paths are
    # limited; /tmp/ray may be someone else's). Ray 2.60 has no loopback-only mode.
    topology.ray_temp_dir = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    ray = topology.start("ray-head", [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
        f"--port={ray_port}", f"--num-cpus={SYSTEMS}", f"--resources={{\"csx\": {SYSTEMS}}}",
        "--include-dashboard=false", "--disable-usage-stats",
        f"--temp-dir={topology.ray_temp_dir}", f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}"], env)
    # api, in its compose command's order, while the two above start. Its `ray start --address
    # --num-cpus=0` is left out: a driver needs a raylet on its own host, and here the head's is.
    assert postgres.is_ready("csx"), "pg_isready"
    migrate = subprocess.run([sys.executable, "-m", "alembic", "upgrade", "head"], cwd=REPO_ROOT,
                             env={**os.environ, **env}, capture_output=True, text=True)
    assert migrate.returncode == 0, migrate.stderr[-3000:]
    topology.token = create_token(topology.database_url)
    wait_until_up(f"{topology.mlflow_url}/health", mlflow, START_TIMEOUT_S)
    wait_for_line(RAY_STARTED, ray, START_TIMEOUT_S)
    api = topology.start("api", [sys.executable, "-m", "uvicorn", "service.main:app",
                                 "--host", HOST, "--port", str(api_port),
                                 "--workers", env["CSX_API_WORKERS"],
                                 "--timeout-worker-healthcheck", str(WORKER_HEALTHCHECK_S)], env)
    wait_until_up(f"{topology.api_url}/v1/healthz", api, START_TIMEOUT_S)


def create_token(database_url: str) -> str:
    engine = make_engine(Settings(database_url=database_url).database_url)
    try:
        with make_sessionmaker(engine)() as session:
            _, secret = crud.create_token(session, name=TOKEN_NAME, is_admin=True)
            session.commit()
    finally:
        engine.dispose()
    return secret


@pytest.fixture
def topology(postgres: PostgresServer, tmp_path: Path) -> Iterator[Topology]:
    stack = Topology(state_dir=tmp_path)
    try:
        start_topology(stack, postgres)
        yield stack
    finally:
        stack.stop()
    assert processes_with_env(f"CSX_TOPOLOGY_TEST={tmp_path}\0") == [], \
        "processes of the topology survived"


def wait_for_study(topology: Topology, http: httpx.Client, study_id: int) -> dict[str, Any]:
    deadline = time.monotonic() + STUDY_TIMEOUT_S
    while time.monotonic() < deadline:
        topology.check_alive()
        study = http.get(f"/v1/studies/{study_id}").json()
        if study["status"] == "DONE":
            return study
        time.sleep(0.5)
    raise AssertionError(f"study {study_id} did not finish in {STUDY_TIMEOUT_S} s; api log:\n"
                         f"{topology.process('api').log_tail()}")


def mlflow_runs(topology: Topology) -> tuple[str, list[dict[str, Any]]]:
    """(experiment id, runs) of the study's experiment (per user: `<user>/EXPERIMENT`) through
    MLflow's REST API as the admin, with flattened tags/params/metrics dicts."""
    with httpx.Client(base_url=f"{topology.mlflow_url}/api/2.0/mlflow", timeout=30,
                      auth=(ADMIN, topology.admin_password)) as mlflow:
        found = mlflow.get("/experiments/get-by-name",
                           params={"experiment_name": f"{TOKEN_NAME}/{EXPERIMENT}"})
        assert found.status_code == 200, found.text
        experiment_id = found.json()["experiment"]["experiment_id"]
        search = mlflow.post("/runs/search", json={"experiment_ids": [experiment_id],
                                                   "max_results": 100})
        assert search.status_code == 200, search.text
    runs = []
    for run in search.json().get("runs", []):
        data = run["data"]
        runs.append({"id": run["info"]["run_id"], "status": run["info"]["status"],
                     "tags": {t["key"]: t["value"] for t in data.get("tags", [])},
                     "params": {p["key"]: p["value"] for p in data.get("params", [])},
                     "metrics": {m["key"]: m["value"] for m in data.get("metrics", [])}})
    return experiment_id, runs


def listening_addresses(process: StackProcess, port: int | None = None) -> set[str]:
    """Addresses that `process` and its descendants listen on (on `port` only, if given)."""
    tree = [process.popen.pid, *descendants(process.popen.pid)]
    return {ip for ip, bound in listening_sockets(tree) if port is None or bound == port}


def test_topology_environment_matches_compose(tmp_path: Path) -> None:
    topology = Topology(state_dir=tmp_path)
    assert set(topology.api_environment()) == set(compose_environment("api"))
    for service in ("ray-head", "ray-worker"):
        assert set(compose_environment(service)) <= set(topology.api_environment())
    assert set(compose_environment("mlflow")) == set(topology.mlflow_environment())
    mlflow_command = COMPOSE["services"]["mlflow"]["command"]
    for option in ("--app-name basic-auth", "--workers 1", "--backend-store-uri postgresql+psycopg://", "--artifacts-destination",
                   "--serve-artifacts"):
        assert option in mlflow_command
    api = compose_environment("api")
    assert api["CSX_MLFLOW_TRACKING_URI"].startswith("http://")  # the mlflow service, over HTTP
    assert api["CSX_MLFLOW_TRACKING_URI"] == api["MLFLOW_TRACKING_URI"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_study_through_the_compose_topology(topology: Topology,
                                           postgres: PostgresServer) -> None:
    with httpx.Client(base_url=topology.api_url, timeout=120,
                      headers={"Authorization": f"Bearer {topology.token}"}) as http:
        health = http.get("/v1/healthz").json()
        assert health == {"status": "ok", "database": "ok", "scheduler": "running"}
        created = http.post("/v1/studies", json=STUDY)
        assert created.status_code == 201, created.text
        study = wait_for_study(topology, http, created.json()["id"])
        assert {j["status"] for j in study["jobs"]} == {"SUCCEEDED"}, \
            [(j["name"], j["status"], j["status_message"]) for j in study["jobs"]]
        report = http.get(f"/v1/studies/{study['id']}/report").json()
        assert report["complete"] and [r["variant"] for r in report["rows"]] == VARIANTS

    # Loopback only, except Ray: 2.60 rewrites a 127.0.0.1 node address to the routable one and
    # binds gcs_server, raylet and each driver's core worker to every interface.
    assert listening_sockets([postgres.pid()]) == {(HOST, postgres.port)}
    assert listening_addresses(topology.process("mlflow")) == {HOST}
    api_port = int(topology.api_url.rsplit(":", 1)[1])
    assert listening_addresses(topology.process("api"), api_port) == {HOST}

    # The service's database: the study row, its jobs and their event rows.
    engine = make_engine(Settings(database_url=topology.database_url).database_url)
    try:
        with make_sessionmaker(engine)() as session:
            studies = session.scalars(select(Study)).all()
            jobs = session.scalars(select(Job).order_by(Job.id)).all()
            events = {job.id: [(e.from_status, e.to_status) for e in session.scalars(
                select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.id))]
                for job in jobs}
    finally:
        engine.dispose()
    assert [s.id for s in studies] == [study["id"]]
    row = studies[0]
    assert row.name == "topology" and row.experiment == EXPERIMENT and row.mlflow_run_id
    assert [j.study_id for j in jobs] == [row.id] * len(VARIANTS)
    assert [j.tags["csx.variant"] for j in jobs] == VARIANTS
    assert [j.status for j in jobs] == ["SUCCEEDED"] * len(VARIANTS)
    assert all(j.num_csx == 2 and j.systems == [] and j.attempt == 1 for j in jobs)
    for job in jobs:
        assert events[job.id] == SUCCESS_PATH, (job.name, events[job.id])
        assert job.result["num_csx"] == 2 and job.result["steps"] == 4
        assert job.result["comm/allreduce_calls"] > 4  # gloo: one per step, plus eval/checks
        assert job.result["final_eval_perplexity"] > 1

    # MLflow, through its REST API: the parent run and one nested run per variant.
    # csx.status tags are applied by the server's tagging thread, moments after the move, and
    # the scheduler logs the finished study's report and ends its parent run at a later tick.
    def tagged() -> tuple[str, list[dict]] | None:
        found = mlflow_runs(topology)
        variants = [run for run in found[1] if run["id"] != row.mlflow_run_id]
        parents = [run for run in found[1] if run["id"] == row.mlflow_run_id]
        done = all(run["tags"].get("csx.status") == "SUCCEEDED" for run in variants)
        return found if done and parents and parents[0]["status"] == "FINISHED" else None

    experiment_id, runs = wait_for(tagged, 60, "csx.status tags on every run, the parent run ended")
    anonymous = httpx.get(f"{topology.mlflow_url}/api/2.0/mlflow/experiments/get",
                          params={"experiment_id": experiment_id}, timeout=30)
    assert anonymous.status_code == 401
    assert row.mlflow_experiment_id == experiment_id
    assert all(j.mlflow_experiment_id == experiment_id for j in jobs)
    by_id = {run["id"]: run for run in runs}
    assert set(by_id) == {row.mlflow_run_id, *(j.mlflow_run_id for j in jobs)}
    parent = by_id[row.mlflow_run_id]
    assert "mlflow.parentRunId" not in parent["tags"]
    assert parent["tags"]["csx.study_id"] == str(row.id) and parent["status"] == "FINISHED"
    for job, variant in zip(jobs, VARIANTS):
        run = by_id[job.mlflow_run_id]
        assert run["tags"]["mlflow.parentRunId"] == row.mlflow_run_id
        assert run["tags"]["csx.status"] == "SUCCEEDED" and run["status"] == "FINISHED"
        assert run["params"]["algorithm"] == variant
        assert run["params"]["num_csx"] == "2"
        assert run["metrics"]["eval/perplexity"] == pytest.approx(
            job.result["final_eval_perplexity"])
        assert {"train/loss", "eval/loss", "host/tokens_per_s"} <= set(run["metrics"])
    rigl = by_id[jobs[1].mlflow_run_id]
    assert rigl["params"]["target_sparsity"] == "0.8"
    assert rigl["metrics"]["sparsity/global"] == pytest.approx(0.8, abs=0.02)
    assert by_id[jobs[0].mlflow_run_id]["metrics"]["sparsity/global"] == 0.0  # dense
    # Artifacts went through the server (--serve-artifacts) into its local folder.
    stored = {path.name for path in topology.artifacts_dir.rglob("*") if path.is_file()}
    assert {"params.yaml", "study_report.json", "masks.npz"} <= stored
