"""The runner joins an existing cluster named by RAY_ADDRESS (`ray start --head`), and a
two-node cluster (two `ray start` on 127.0.0.1, one `csx` system each) runs a num_csx 2 job
with one worker on each node.

The test process already holds the session's local runtime and a Ray driver cannot join two,
so the job's driver runs in a subprocess. Each node runs in its own session (setsid), and
only the processes of those sessions are killed afterwards: `ray stop` would kill every Ray
process on the machine, and gcs_server ignores SIGTERM.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

RAY = str(Path(sys.executable).with_name("ray"))
DRIVER = """
import json, sys
from workers.runner import run_job
from csx_config import JobSpec
from training.plan import plan_job
spec = JobSpec.from_yaml(sys.argv[2])
summary = run_job(plan_job(spec, 2), model_dir=sys.argv[1], tracking=False)
print("SUMMARY " + json.dumps({k: summary[k] for k in ("steps", "mask_hashes", "num_csx")}))
"""
SPEC = """
train_input: {batch_size: 4, max_sequence_length: 16}
model: {preset: tiny}
sparsity: {algorithm: rigl, sparsity: 0.8, update: {freq: 2}}
runconfig: {max_steps: 4, log_steps: 2, seed: 0}
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def session_members(session_id: int) -> list[int]:
    """Processes whose session id is `session_id` (field 6 of /proc/<pid>/stat)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # exited meanwhile
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) == session_id and fields[0] != "Z":
                members.append(int(entry.name))
    return members


@contextmanager
def ray_node(*args: str) -> Iterator[subprocess.Popen]:
    """`ray start --block ARGS` in a session of its own; every process of that session is
    killed on exit."""
    node = subprocess.Popen(
        [RAY, "start", "--block", "--disable-usage-stats",
         f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
         *args],
        env={**os.environ, "RAY_AUTH_MODE": "disabled"}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield node
    finally:
        deadline = time.monotonic() + 10
        while (members := session_members(node.pid)) and time.monotonic() < deadline:
            for pid in members:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        node.wait(timeout=10)
        assert not session_members(node.pid), "processes of the test cluster survived"


def head_args(port: int, temp_dir: str, cpus: int, systems: int) -> list[str]:
    return ["--head", "--include-dashboard=false", "--node-ip-address=127.0.0.1", f"--port={port}",
            f"--num-cpus={cpus}",
            f'--resources={{"csx": {systems}}}', f"--temp-dir={temp_dir}",
            f"--ray-client-server-port={free_port()}"]


@pytest.fixture()
def ray_cluster() -> Iterator[str]:
    """A one-node cluster (2 CPUs, 2 systems) started by `ray start --head` for this test
    only; its address."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: socket paths are limited
    try:
        with ray_node(*head_args(port, temp_dir, cpus=2, systems=2)):
            yield f"127.0.0.1:{port}"
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture()
def two_node_cluster() -> Iterator[str]:
    """A head and a second node on 127.0.0.1, one CPU and one `csx` system each."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    try:
        with ray_node(*head_args(port, temp_dir, cpus=1, systems=1)):
            with ray_node(f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1",
                          "--num-cpus=1", '--resources={"csx": 1}'):
                yield f"127.0.0.1:{port}"
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def run_driver(script: str, address: str, *args: str) -> dict:
    driver = subprocess.run(
        [sys.executable, "-c", script, *args],
        env={**os.environ, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled"},
        capture_output=True, text=True, timeout=240)
    assert driver.returncode == 0, driver.stderr[-3000:]
    assert "Connecting to existing Ray cluster at address: " in driver.stderr
    line = next(l for l in driver.stdout.splitlines() if l.startswith("SUMMARY "))
    return json.loads(line.removeprefix("SUMMARY "))


def test_run_job_joins_the_cluster_in_ray_address(ray_cluster, tmp_path):
    summary = run_driver(DRIVER, ray_cluster, str(tmp_path / "model"), SPEC)
    assert summary["steps"] == 4 and summary["num_csx"] == 2
    assert [step for step, _ in summary["mask_hashes"]] == [0, 2, 4]


SPREAD_DRIVER = """
import json, sys, time
import ray
from workers.runner import connect_ray, run_job
from csx_config import JobSpec
from service.cluster import live_summary
from training.plan import plan_job
connect_ray(systems=2)
deadline = time.monotonic() + 120
while ray.cluster_resources().get("csx", 0) < 2 and time.monotonic() < deadline:
    time.sleep(0.2)  # the second node registers after the head
cluster = live_summary()
summary = run_job(plan_job(JobSpec.from_yaml(sys.argv[2]), 2), model_dir=sys.argv[1], tracking=False)
print("SUMMARY " + json.dumps({"systems": cluster.systems, "nodes": cluster.nodes,
                               "workers": summary["workers"], "steps": summary["steps"],
                               "cpus_per_csx": summary["cpus_per_csx"]}))
"""
SPREAD_SPEC = """
train_input: {batch_size: 2, max_sequence_length: 8}
model: {preset: tiny}
runconfig: {max_steps: 2, log_steps: 2, seed: 0, placement_strategy: SPREAD}
"""


def test_a_two_system_job_runs_one_worker_on_each_node(two_node_cluster, tmp_path):
    """The service's capacity is the cluster's csx resource (2, on 2 nodes), and a num_csx 2
    job places one worker, with the node's one CPU, on each node."""
    summary = run_driver(SPREAD_DRIVER, two_node_cluster, str(tmp_path / "model"), SPREAD_SPEC)
    assert (summary["systems"], summary["nodes"]) == (2, 2)
    assert summary["steps"] == 2 and summary["cpus_per_csx"] == 1
    workers = summary["workers"]
    assert len({worker["node_id"] for worker in workers}) == 2
    assert [worker["threads"] for worker in workers] == [1, 1]
