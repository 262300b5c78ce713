"""Alembic: head matches the models, and the chain goes down and up again (SQLite batch mode)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from sqlalchemy import inspect

from service.db import alembic_config, make_engine
from service_helpers import assert_schema_matches_models


def test_sqlite_head_matches_models_and_round_trips(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    assert_schema_matches_models(url)
    command.downgrade(alembic_config(url), "base")
    engine = make_engine(url)
    assert set(inspect(engine).get_table_names()) == {"alembic_version"}
    engine.dispose()
    assert_schema_matches_models(url)


def test_sqlite_uses_wal(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'w.db'}")
    with engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    engine.dispose()
