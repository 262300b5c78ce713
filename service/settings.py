"""Service settings: one validated object, read from CSX_* environment variables.

Local defaults need nothing running: SQLite in WAL mode for jobs, a SQLite MLflow store (MLflow 3
refuses the plain file store unless forced).
docker-compose.yml overrides them with PostgreSQL, an MLflow server and a Ray cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field, PrivateAttr, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.cluster import machine_summary
from service.processes import RAY_WORKER_PORTS, check_clear_of_ray_workers
from service.mlflow_auth import MlflowAccess
from workers.hardware import ClusterSummary


POSTGRES_PORT = 5432


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CSX_", extra="ignore")

    database_url: str = "sqlite:///./csx.db"
    # Simulated CS-2 systems of the service's own local Ray head (the `csx` resource it
    # declares); None: the machine's default, one per GPU, else one per core. A cluster joined
    # through RAY_ADDRESS declares its own. The scheduler hands out what the cluster declares
    # (`systems`); a job holds num_csx of them until it ends.
    cluster_size: int | None = Field(default=None, ge=1, le=1024)
    runs_dir: Path = Path("./runs")
    mlflow_tracking_uri: str = "sqlite:///./mlflow.db"
    mlflow_ui_url: str = "http://127.0.0.1:5000"
    # MLflow's authentication (service/mlflow_auth.py), on when the admin password is set: the
    # tracking server runs `--app-name basic-auth` with this admin account (docker-compose
    # requires the password; `csx serve` makes one for the UI it starts when the database holds
    # several users' tokens). No password: MLflow is open, for a single-user stack only.
    mlflow_admin_username: str = Field(default="csx-service", min_length=1, max_length=100)
    mlflow_admin_password: SecretStr | None = Field(default=None, min_length=12)
    # Where train_input/eval_input data_dir may point besides "builtin:<name>" data sets.
    allowed_data_roots: list[Path] = [Path("./data")]
    # Accept and queue jobs but start none: for load tests and maintenance.
    paused: bool = False
    # Create an admin token named "dev" on start and print it (for `make run` on a laptop).
    dev_token: bool = False
    max_body_bytes: int = Field(default=10 * 1024 * 1024, ge=1024)
    # Memory each CS-2 system's worker may use; a job needs its plan's per-worker estimate to
    # fit. Default: the least memory a cluster node has per system it declares (before the
    # local head runs: this machine's physical memory shared by its systems).
    # timeout_s of a job that gives none: no job holds its systems forever.
    default_timeout_s: float = Field(default=86400.0, gt=0, le=30 * 86400, allow_inf_nan=False)
    memory_per_csx_gib: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # Longest time between two scheduler passes when nothing wakes it (a submission, cancel,
    # retry or ending job in this process does): how late a timeout, a lost node or a job
    # queued through another server is seen. Each pass reads the database (0.2 s: a twentieth
    # of an idle server's core).
    scheduler_interval_s: float = Field(default=1.0, gt=0, le=60)
    # Least time between two scheduler passes: bounds its share of the CPU under a burst of
    # submissions; a queued job starts at most this much later.
    scheduler_min_gap_s: float = Field(default=0.1, ge=0, le=1)
    # "module:function" with workers.runner.run_job's signature; the executor calls it in a thread.
    job_runner: str = "workers.runner:run_job"
    run_migrations_on_start: bool = True
    # Requests served at once with a database connection each: the API's pool holds this many,
    # so a request never waits on the event loop for a connection another request holds.
    db_pool_size: int = Field(default=40, ge=2, le=1000)
    # Longest wait for one of them (or for the database) before answering 503 + Retry-After.
    db_wait_s: float = Field(default=10.0, gt=0, le=300, allow_inf_nan=False)
    # API processes `csx serve` runs on its port (uvicorn's workers; one Python process uses
    # one core, docs/benchmarks.md): one schedules, the others stand by and answer the API.
    api_workers: int = Field(default=1, ge=1, le=64)
    # Failed authentications a client address may make per window before its requests answer
    # 429 with Retry-After (service/limits.py), in all: each of `api_workers` processes counts
    # its share, so a client spreading its guesses over them gets no more.
    auth_failures_max: int = Field(default=10, ge=1, le=10_000)
    auth_failures_window_s: float = Field(default=60.0, gt=0, le=86400, allow_inf_nan=False)
    # One scheduler per database: the server holding the lease renews it every tick; a second
    # server refuses to start until it expires (or its holder on this host is gone).
    lease_ttl_s: float = Field(default=30.0, ge=1, le=3600, allow_inf_nan=False)

    # Ports Ray's workers bind on the Ray head the service starts; the API's, MLflow's and the
    # database's must lie outside (`check_clear_of_ray_workers`). JSON: [20000, 29999].
    ray_worker_ports: tuple[int, int] = RAY_WORKER_PORTS

    @field_validator("ray_worker_ports")
    @classmethod
    def _worker_port_range(cls, ports: tuple[int, int]) -> tuple[int, int]:
        low, high = ports
        if not 1024 <= low <= high <= 65535:
            raise ValueError(f"must be [low, high] with 1024 <= low <= high <= 65535, not {ports}")
        return ports

    def check_clear_of_ray_workers(self, api_port: int | None = None) -> None:
        """ValueError naming the setting (or `--port`) whose port Ray's workers could take."""
        from sqlalchemy.engine import make_url

        database = make_url(self.database_url)
        ports = {"--port": api_port, "CSX_MLFLOW_UI_URL": urlsplit(self.mlflow_ui_url).port,
                 "CSX_DATABASE_URL": ((database.port or POSTGRES_PORT)
                                      if database.get_backend_name() == "postgresql" else None)}
        if self.mlflow_tracking_uri.startswith("http"):
            ports["CSX_MLFLOW_TRACKING_URI"] = urlsplit(self.mlflow_tracking_uri).port
        check_clear_of_ray_workers(self.ray_worker_ports, ports)

    @field_validator("database_url")
    @classmethod
    def _normalise_postgres_driver(cls, url: str) -> str:
        # "postgresql://" would pick psycopg2, which is not installed; psycopg 3 is.
        if url.startswith("postgres://"):
            url = "postgresql://" + url.removeprefix("postgres://")
        if url.startswith("postgresql://"):
            url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
        return url

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _absolute_sqlite_store(cls, uri: str) -> str:
        # Ray workers may run in another directory; they must write to the same store.
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
            return "sqlite:///" + str(Path(uri.removeprefix("sqlite:///")).resolve())
        return uri

    @field_validator("runs_dir")
    @classmethod
    def _absolute_runs_dir(cls, path: Path) -> Path:
        return path.expanduser().resolve()

    # The scheduler's Ray launcher reads the live cluster through this (service/cluster.py).
    _cluster_reader: Callable[[], ClusterSummary] | None = PrivateAttr(default=None)

    def read_cluster_from(self, reader: Callable[[], ClusterSummary]) -> None:
        self._cluster_reader = reader

    def cluster(self) -> ClusterSummary:
        """The cluster jobs run on: the launcher's live Ray cluster, else this machine
        declaring `cluster_size` systems (a test's launcher, or no launcher yet)."""
        if self._cluster_reader is not None:
            return self._cluster_reader()
        return machine_summary(self.cluster_size)

    @property
    def systems(self) -> int:
        return self.cluster().systems

    @property
    def memory_per_csx_bytes(self) -> int:
        if self.memory_per_csx_gib is not None:
            return int(self.memory_per_csx_gib * 2**30)
        return int(self.cluster().memory_per_system_bytes)

    @property
    def mlflow_access(self) -> MlflowAccess | None:
        if self.mlflow_admin_password is None:
            return None
        return MlflowAccess(self.mlflow_tracking_uri, self.mlflow_admin_username,
                            self.mlflow_admin_password.get_secret_value())

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")
