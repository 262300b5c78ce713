"""The MLflow experiments the service owns: the only ones its jobs and studies log to.

With MLflow's basic-auth app any user may create an experiment of any name, and whoever
creates one manages it (reads and deletes every run in it). Jobs used to find their
experiment by name (`<user>/<experiment>`, service/mlflow_auth.py), so a user who created
`alice/squat` before Alice's first job there received her runs. Now:

- the service creates each experiment itself (its admin account when MLflow authenticates),
  at the start of the first job or study that needs it (a job's execution thread, never a
  request, which must not wait on MLflow), and records its id per owner and experiment name
  in the database (table `mlflow_experiments`); the workers get that id, never a name;
- an experiment of the wanted name that this table does not hold is never used, whoever
  made it: the service creates its own under a distinct name, `<name> (csx <8 hex>)`,
  random so that nobody can take it first, and the job's `mlflow_url` points at it;
- runs are looked up by tag only inside these experiments, where nobody but the service
  writes (users get READ).

A job needs its server to answer before it starts (its experiment, its run, its study's parent
run): the scheduler asks it first (tracking/server.py) and waits while it does not answer.
"""

from __future__ import annotations

import secrets
import threading

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from service.mlflow_auth import experiment_name
from service.models import MlflowExperiment
from service.settings import Settings

# MLflow keeps experiment names in a String(256) column on a database server.
MAX_MLFLOW_NAME = 256
# How many random names to try when the wanted one is taken (each clash is a 1 in 2^32 chance).
NAME_TRIES = 4
# One creation at a time per (owner, name) in this process: two jobs starting at once share
# one experiment, and an MLflow server slow to answer holds up only that experiment's jobs.
_creating: dict[tuple[int, str], threading.Lock] = {}
_creating_guard = threading.Lock()


def owned_experiment_id(sessions: sessionmaker[Session], settings: Settings, *,
                        owner_id: int, owner_name: str, experiment: str) -> str:
    """The id of the MLflow experiment the service created for `owner`'s `experiment`,
    creating it on first use (an MLflow call: never inside a database transaction)."""
    with _creating_guard:
        creating = _creating.setdefault((owner_id, experiment), threading.Lock())
    with creating:
        recorded = _recorded(sessions, owner_id, experiment)
        if recorded is not None:
            return recorded
        wanted = experiment_name(settings.mlflow_access, owner_name, experiment)
        mlflow_name, experiment_id = _create(settings, wanted)
        try:
            with sessions() as session:
                session.add(MlflowExperiment(owner_id=owner_id, name=experiment,
                                             mlflow_name=mlflow_name,
                                             mlflow_experiment_id=experiment_id))
                session.commit()
        except IntegrityError:
            # Another server recorded one first (the lease changed hands meanwhile): theirs
            # stands, and the one made here stays empty.
            recorded = _recorded(sessions, owner_id, experiment)
            if recorded is None:
                raise
            return recorded
    if (access := settings.mlflow_access) is not None:
        from service import run_tags

        run_tags.submit_write(access.tracking_uri, f"letting {owner_name} read experiment "
                              f"{experiment_id}",
                              lambda: access.grant_read(owner_name, [experiment_id]))
    return experiment_id


def _recorded(sessions: sessionmaker[Session], owner_id: int, experiment: str) -> str | None:
    with sessions() as session:
        return session.scalar(select(MlflowExperiment.mlflow_experiment_id).where(
            MlflowExperiment.owner_id == owner_id, MlflowExperiment.name == experiment))


def _create(settings: Settings, wanted: str) -> tuple[str, str]:
    """(MLflow name, id) of a new experiment named `wanted`, or a distinct name when taken."""
    from mlflow.tracking import MlflowClient

    from tracking.tracker import new_experiment

    client = MlflowClient(settings.mlflow_tracking_uri)
    names = [wanted[:MAX_MLFLOW_NAME]]
    for _ in range(NAME_TRIES):
        suffix = f" (csx {secrets.token_hex(4)})"
        names.append(wanted[:MAX_MLFLOW_NAME - len(suffix)] + suffix)
    for name in names:
        experiment_id = new_experiment(client, name)
        if experiment_id is not None:
            return name, experiment_id
    raise RuntimeError(f"every MLflow experiment name tried for {wanted!r} was taken")


def find_run(settings: Settings, experiment_id: str, tags: dict[str, str]) -> str | None:
    """The oldest run of the service's experiment `experiment_id` carrying every one of
    `tags` (values without quotes: ids and roles): one a server created and was stopped
    before it recorded, so that the next attempt adopts it rather than leave it orphaned."""
    from mlflow.tracking import MlflowClient

    query = " and ".join(f"tags.`{key}` = '{value}'" for key, value in tags.items())
    runs = MlflowClient(settings.mlflow_tracking_uri).search_runs(
        [experiment_id], query, order_by=["attributes.start_time ASC"], max_results=1)
    return runs[0].info.run_id if runs else None
