"""Engine, sessions and migrations; the only module that knows the database URL's dialect."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
ALEMBIC_INI = MIGRATIONS_DIR.parent / "alembic.ini"


def make_engine(url: str, *, pool_size: int = 10, pool_timeout_s: float = 30.0) -> Engine:
    """`pool_size` connections at most (no overflow): whoever takes the engine sizes it to the
    threads that use it, and a wait past `pool_timeout_s` raises instead of hanging."""
    pool = {"pool_size": pool_size, "max_overflow": 0, "pool_timeout": pool_timeout_s}
    if not url.startswith("sqlite"):
        # connect_timeout: a database host that drops packets fails a connect in seconds.
        return create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": 5},
                             **pool)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **pool)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        # WAL lets readers run while the scheduler writes; busy_timeout queues writers
        # instead of failing them with "database is locked".
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str) -> Config:
    config = Config(str(ALEMBIC_INI)) if ALEMBIC_INI.exists() else Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # env.py reads this attribute before falling back to Settings, so a caller's URL wins.
    config.attributes["database_url"] = url
    return config


def upgrade_database(url: str) -> None:
    command.upgrade(alembic_config(url), "head")
