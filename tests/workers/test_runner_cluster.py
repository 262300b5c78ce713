"""The runner joins an existing cluster named by RAY_ADDRESS (`ray start --head`).

The test process already holds the session's local runtime and a Ray driver cannot join two,
so the job's driver runs in a subprocess. The cluster runs in its own session (setsid), and
only the processes of that session are killed afterwards: `ray stop` would kill every Ray
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
from pathlib import Path

import pytest

RAY = str(Path(sys.executable).with_name("ray"))
DRIVER = """
import json, sys
from workers.runner import run_job
from csx_config import JobSpec
spec = JobSpec.from_yaml(sys.argv[2])
summary = run_job(spec, num_csx=2, model_dir=sys.argv[1], tracking=False)
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


@pytest.fixture()
def ray_cluster() -> Iterator[str]:
    """A one-node cluster started by `ray start --head` for this test only; its address."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: socket paths are limited
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--include-dashboard=false", "--num-cpus=2", '--resources={"csx": 2}',
         f"--temp-dir={temp_dir}",
         f"--ray-client-server-port={free_port()}",
         f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats"],
        env={**os.environ, "RAY_AUTH_MODE": "disabled"}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        deadline = time.monotonic() + 10
        while (members := session_members(head.pid)) and time.monotonic() < deadline:
            for pid in members:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        head.wait(timeout=10)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not session_members(head.pid), "processes of the test cluster survived"


def test_run_job_joins_the_cluster_in_ray_address(ray_cluster, tmp_path):
    driver = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path / "model"), SPEC],
        env={**os.environ, "RAY_ADDRESS": ray_cluster, "RAY_AUTH_MODE": "disabled"},
        capture_output=True, text=True, timeout=240)
    assert driver.returncode == 0, driver.stderr[-3000:]
    assert "Connecting to existing Ray cluster at address: " in driver.stderr
    line = next(l for l in driver.stdout.splitlines() if l.startswith("SUMMARY "))
    summary = json.loads(line.removeprefix("SUMMARY "))
    assert summary["steps"] == 4 and summary["num_csx"] == 2
    assert [step for step, _ in summary["mask_hashes"]] == [0, 2, 4]
