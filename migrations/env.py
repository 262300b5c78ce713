"""Alembic environment: metadata from service.models, URL from the caller or service.settings."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection

from service.db import make_engine
from service.models import Base
from service.settings import Settings

config = context.config
# Only the `alembic` command line configures logging; an in-process upgrade keeps the app's.
if config.config_file_name is not None and "database_url" not in config.attributes:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def database_url() -> str:
    return config.attributes.get("database_url") or Settings().database_url


def configure(connection: Connection | None = None, url: str | None = None) -> None:
    dialect = connection.dialect.name if connection is not None else (url or "").split(":")[0]
    context.configure(
        connection=connection,
        url=url,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode copies the table so a migration never
        # half-applies.
        render_as_batch=dialect.startswith("sqlite"),
        compare_type=True,
        literal_binds=connection is None,
    )


def run_migrations_offline() -> None:
    configure(url=database_url())
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(database_url())
    try:
        with engine.connect() as connection:
            sqlite = connection.dialect.name == "sqlite"
            if sqlite:
                # Batch mode alters a table by copying it and dropping the old one, which the
                # rows pointing at it (job_events -> jobs) forbid while foreign keys are on;
                # the pragma only takes effect outside a transaction. Checked afterwards.
                connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
                connection.commit()  # end the transaction SQLAlchemy began for the pragma
            configure(connection=connection)
            with context.begin_transaction():
                context.run_migrations()
            if sqlite:
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                connection.exec_driver_sql("PRAGMA foreign_keys=ON")
                connection.commit()
                if broken:
                    raise RuntimeError(f"the migration left rows pointing at nothing: {broken[:5]}")
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
