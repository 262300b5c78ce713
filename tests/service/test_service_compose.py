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
    assert services["api"]["environment"]["CSX_DATABASE_URL"].startswith("postgresql://")
    assert services["api"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    api_command = services["api"]["command"]
    assert api_command.index("pg_isready") < api_command.index("alembic upgrade head") < \
        api_command.index("uvicorn")
    init_sql = services["postgres"]["volumes"][1].split(":")[0]
    assert (ROOT / init_sql).is_file()


def test_dockerfile_copies_what_the_api_needs() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    for needed in ("COPY service", "COPY migrations", "COPY alembic.ini", "torch==2.13.0"):
        assert needed in dockerfile
