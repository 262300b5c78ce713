"""Shared fixtures: one private Ray runtime per test session, a throwaway MLflow store; which
tests share a pytest-xdist worker."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


# `make test` runs two xdist workers (`-n 2 --dist loadgroup`); a group runs on one worker, in
# order. Tests on the session's Ray runtime share it (one start, not two). The other slow tests
# start Ray heads, servers and stacks of their own: one at a time, as before xdist, so at most
# that one and the session runtime run at once. Every other test stays with its module (module
# fixtures are built once).
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "ray_session" in item.fixturenames:
            group = "ray_session"
        elif item.get_closest_marker("slow") or "ray_cluster" in item.fixturenames:
            group = "own_servers"
        else:
            group = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """A private local Ray runtime for the whole session, shut down at the end.

    `address="local"` starts a private runtime even when RAY_ADDRESS points at a cluster,
    so tests never touch a shared one; `ray.shutdown()` stops exactly what it started.
    Four logical CPUs let four one-CPU actors (num_csx = 4) run on a 2-core machine. (Ray
    2.60 rewrites a 127.0.0.1 node address to the routable one, so none is asked for; the
    runner's gloo rendezvous does use loopback.)
    """
    os.environ["RAY_AUTH_MODE"] = "disabled"  # token auth is on by default in Ray 2.60
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(address="local", include_dashboard=False, num_cpus=4,
             object_store_memory=200 * 1024 * 1024, log_to_driver=False,
             configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One throwaway SQLite MLflow store per session (creating its schema takes ~1 s)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
