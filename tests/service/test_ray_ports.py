"""Ray's workers bind a port range clear of the service's own ports (issue 32, fault 10): Ray's
default range (10002-19999) held ports an operator may give the API or MLflow, and a worker
that took one first kept that server from starting."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from service.cli import main as csx_service
from service.local_stack import LocalStack
from service.processes import RAY_WORKER_PORTS
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
LOW, HIGH = RAY_WORKER_PORTS


@given(port=st.integers(1, 65535))
def test_every_service_port_is_checked_against_the_worker_range(port: int) -> None:
    inside = LOW <= port <= HIGH
    for setting, settings, api_port in (
            ("--port", Settings(), port),
            ("CSX_MLFLOW_UI_URL", Settings(mlflow_ui_url=f"http://127.0.0.1:{port}"), None),
            ("CSX_MLFLOW_TRACKING_URI",
             Settings(mlflow_tracking_uri=f"http://mlflow:{port}"), None),
            ("CSX_DATABASE_URL", Settings(database_url=f"postgresql://csx@db:{port}/csx"), None)):
        if inside:
            with pytest.raises(ValueError, match=f"{setting} uses port {port}.*"
                                                 "CSX_RAY_WORKER_PORTS"):
                settings.check_clear_of_ray_workers(api_port)
        else:
            settings.check_clear_of_ray_workers(api_port)


def test_postgres_default_port_and_a_moved_range() -> None:
    moved = Settings(ray_worker_ports=(5400, 5499), database_url="postgresql://csx@db/csx")
    with pytest.raises(ValueError, match="CSX_DATABASE_URL uses port 5432"):
        moved.check_clear_of_ray_workers()
    with pytest.raises(ValueError, match="ray_worker_ports"):
        Settings(ray_worker_ports=(30000, 20000))


def test_csx_serve_refuses_a_port_ray_workers_may_take(capsys: pytest.CaptureFixture[str]) -> None:
    assert csx_service(["serve", "--port", str(LOW + 5)]) == 2
    error = capsys.readouterr().err
    assert f"--port uses port {LOW + 5}" in error and "CSX_RAY_WORKER_PORTS" in error


def test_local_stack_refuses_a_port_ray_workers_may_take(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--api-port uses port"):
        LocalStack(tmp_path, api_port=HIGH).start()
    assert not (tmp_path / "logs").exists()  # nothing was started


def test_compose_ray_nodes_bind_workers_clear_of_every_published_port() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    words = {name: (" ".join(command) if isinstance(command, list) else command).split()
             for name, service in services.items() if (command := service.get("command"))}
    ray_nodes = {name for name, command in words.items() if "ray" in command and "start" in command}
    assert ray_nodes == {"ray-head", "ray-worker", "api"}
    for name in ray_nodes:
        assert {f"--min-worker-port={LOW}", f"--max-worker-port={HIGH}"} <= set(words[name]), name
    published = {int(port.split(":")[-1]) for service in services.values()
                 for port in service.get("ports", [])} | {5432, 6379}  # PostgreSQL, Ray's GCS
    assert published and not any(LOW <= port <= HIGH for port in published)
