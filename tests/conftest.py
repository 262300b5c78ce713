"""Shared fixtures: one private Ray runtime per test session, a throwaway MLflow store; which
tests share a pytest-xdist worker."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import settings

# No test is timed (bench/ measures speed): an example that a busy machine slows past
# hypothesis' default 200 ms deadline must not fail (under `-n 4` one took 526 ms, then 0.9).
settings.register_profile("csx", deadline=None)
settings.load_profile("csx")


# `make test` runs two xdist workers (`-n 2`); a group of tests runs on one worker, in order.
# Tests on the session's Ray runtime share it (one start, not two). Tests that start Ray heads,
# servers and stacks of their own run one at a time, as before xdist, so at most one of them
# and the session runtime run at once. Every other test file is a group of its own (its module
# fixtures are built once). Groups are by file because the controller sees only test ids:
# collection checks the lists below against the tests' fixtures where a fixture tells. (xdist's own
# `--dist loadgroup` does not group on pytest 9.2, which ignores the `_nodeid` it rewrites.)
RAY_SESSION_FILES = frozenset({
    "tests/service/test_service_studies.py",
    "tests/workers/test_runner_plumbing.py",
    "tests/workers/test_runner_train.py",
    "tests/tracking/test_tracking.py",
    "tests/csx/test_cli.py",
    "tests/training/test_modelzoo_e2e.py",
    "tests/training/test_modelzoo_families_e2e.py",
    "tests/training/test_restarts.py",
})
OWN_SERVER_FILES = frozenset({
    "tests/service/test_service_local_stack.py",
    "tests/service/test_service_mlflow_ui.py",
    "tests/service/test_service_restart.py",
    "tests/service/test_service_serve.py",
    "tests/service/test_service_topology.py",
    "tests/test_readme.py",
    "tests/workers/test_runner_cluster.py",
})
# The two long groups first, so each worker starts one of them.
GROUP_ORDER = ("ray_session", "own_servers")


def pytest_configure(config: pytest.Config) -> None:
    # Each session (each xdist worker) measures the CSR-vs-dense costs afresh into a folder of
    # its own (simulator.crossover.machine_calibration), not the user's cache; Ray workers and
    # servers the tests start inherit it.
    os.environ["CSX_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="csx-kernel-cache-")


def xdist_group(test_file: str) -> str:
    if test_file in RAY_SESSION_FILES:
        return "ray_session"
    if test_file in OWN_SERVER_FILES:
        return "own_servers"
    return test_file


def _needed_group(item: pytest.Item) -> str | None:
    if "ray_session" in item.fixturenames:
        return "ray_session"
    if {"ray_cluster", "stack"} & set(item.fixturenames):
        return "own_servers"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    files = [item.nodeid.split("::")[0] for item in items]
    misplaced = [item.nodeid for item, file in zip(items, files)
                 if (needed := _needed_group(item)) and xdist_group(file) != needed]
    if misplaced:
        raise pytest.UsageError("tests/conftest.py: add the files of these tests to "
                                f"RAY_SESSION_FILES or OWN_SERVER_FILES: {misplaced}")
    rank = {group: i for i, group in enumerate(GROUP_ORDER)}
    order = sorted(range(len(items)),
                   key=lambda i: rank.get(xdist_group(files[i]), len(GROUP_ORDER)))
    items[:] = [items[i] for i in order]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid.split("::")[0])

    config.option.loadscopereorder = False  # keep GROUP_ORDER (collection order)
    return GroupScheduling(config, log)


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """A private local Ray runtime for the whole session, shut down at the end.

    `address="local"` starts a private runtime even when RAY_ADDRESS points at a cluster,
    so tests never touch a shared one; `ray.shutdown()` stops exactly what it started.
    Four logical CPUs and four `csx` systems let a num_csx 4 job (one CPU each) run on a
    2-core machine. (Ray
    2.60 rewrites a 127.0.0.1 node address to the routable one, so none is asked for; the
    runner's gloo rendezvous does use loopback.)
    """
    os.environ["RAY_AUTH_MODE"] = "disabled"  # token auth is on by default in Ray 2.60
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(address="local", include_dashboard=False, num_cpus=4, resources={"csx": 4},
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
