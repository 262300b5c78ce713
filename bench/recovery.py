"""Crash recovery of a real training job: a worker kill and an API kill mid-run, then the resumed
run's final checkpoint compared tensor by tensor with an uninterrupted run of the same spec.

One `uvicorn service.main:app` (which starts its own Ray head) on a fresh database, one system
(CSX_CLUSTER_SIZE=1). The spec is examples/rigl.yaml made short: a few hundred tiny-preset steps,
a checkpoint every CHECKPOINT_STEPS, RigL mask updates every 10 steps, and `sparse_kernel:
dense` (the "auto" kernel is chosen by timing in each process, so only a fixed kernel can resume
bit-identically; csx_config/sections.py).

1. The spec runs uninterrupted to SUCCEEDED: the reference final checkpoint.
2. The same spec again: once past its first checkpoint, the CsxWorker actor's process is
   SIGKILLed (the job must go RECOVERING and resume in a fresh actor); later, the API process
   and everything it started (Ray included) are SIGKILLed and the API restarted (the job must
   come back RECOVERING and resume). It must end SUCCEEDED with the reference's final
   model, optimizer and sparsity state, bit for bit.

The checkpoint's global torch RNG state (`rng`) is reported apart, not in the verdict: training
never draws from it (the model initialises under its own seed, data and sparsity use their own
generators), and in a Ray actor it already differs between two runs of the same spec at their
first checkpoint, before any kill. So it says which process wrote the run, not whether the
resume was exact; what the resume owes it, restoring it, is checked as `rng_kept_across_kills`
(the resumed run's final state equals its own first checkpoint's).

Called by bench/reliability.py (`run_recovery(backend)`); alone:

    python bench/recovery.py --backends sqlite
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "service"))  # the tests' server and Postgres helpers
from service_helpers import ServerProcess, is_alive  # noqa: E402

from service.processes import descendants  # noqa: E402

MAX_STEPS = 300
CHECKPOINT_STEPS = 20
WORKER_KILL_AFTER = 2 * CHECKPOINT_STEPS + 5  # past a checkpoint, so the resume skips steps
API_KILL_AFTER = MAX_STEPS // 2 + 5
JOB_DEADLINE_S = 900.0  # per wait, on a busy shared machine
COMPARED = ("model", "optimizer", "sparsity", "lr_scheduler", "data_position", "step")
RECOVERY_MARKERS = ('"event": "recovering"', "resuming after restart")


def recovery_params() -> dict[str, Any]:
    params = yaml.safe_load((ROOT / "examples" / "rigl.yaml").read_text(encoding="utf-8"))
    params.pop("eval_input", None)
    params["sparsity"]["update"] = {"freq": 10, "stop": MAX_STEPS - 50}
    params["sparsity"]["drop_fraction"] = {"type": "cosine", "init": 0.3,
                                           "half_period": MAX_STEPS - 50}
    params["runconfig"] = {"max_steps": MAX_STEPS, "checkpoint_steps": CHECKPOINT_STEPS,
                           "log_steps": 5, "seed": 0, "max_failures": 2,
                           "sparse_kernel": "dense"}
    return params


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline, pause = time.monotonic() + timeout_s, 0.05
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(pause)
        pause = min(pause * 1.5, 0.3)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class Api:
    """The job calls the benchmark makes, against whichever server process is up now."""

    def __init__(self, server: ServerProcess, token: str) -> None:
        self.server, self.auth = server, {"Authorization": f"Bearer {token}"}

    def get(self, path: str) -> Any:
        response = httpx.get(self.server.url + path, headers=self.auth, timeout=30)
        response.raise_for_status()
        return response.json()

    def submit(self, name: str) -> int:
        response = httpx.post(self.server.url + "/v1/jobs", headers=self.auth, timeout=60,
                              json={"name": name, "params": recovery_params()})
        if response.status_code != 201:
            raise RuntimeError(f"submission refused ({response.status_code}): {response.text}")
        return response.json()["id"]

    def job(self, job_id: int) -> dict[str, Any]:
        job = self.get(f"/v1/jobs/{job_id}")
        if job["status"] in ("FAILED", "CANCELLED"):
            raise RuntimeError(f"job {job_id} {job['status']}: {job['status_message']}")
        return job

    def step(self, job_id: int) -> int:
        return (self.job(job_id).get("progress") or {}).get("step", 0)

    def finished(self, job_id: int) -> dict[str, Any]:
        return wait_for(lambda: (job := self.job(job_id))["status"] == "SUCCEEDED" and job,
                        JOB_DEADLINE_S, f"job {job_id} to succeed")

    def statuses(self, job_id: int) -> list[str]:
        return [event["to_status"] for event in self.get(f"/v1/jobs/{job_id}/events")["data"]]

    def first_steps_after_recoveries(self, job_id: int) -> list[int]:
        """From the job log: the first step each recovered attempt logged; past the first
        checkpoint means it resumed from a checkpoint, not from scratch."""
        response = httpx.get(f"{self.server.url}/v1/jobs/{job_id}/logs", headers=self.auth,
                             timeout=30)
        response.raise_for_status()
        found, waiting = [], False
        for line in response.text.splitlines():
            if any(marker in line for marker in RECOVERY_MARKERS):
                waiting = True
            elif waiting and '"step"' in line:
                found.append(json.loads(line.split(" ", 1)[1])["step"])
                waiting = False
        return found


def csx_worker_pids(server: ServerProcess) -> list[int]:
    """The processes of the server's Ray runtime that run a CsxWorker actor (Ray names an
    actor's process `ray::CsxWorker...` once it holds one)."""
    assert server.process is not None
    pids = []
    for pid in descendants(server.process.pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if command.startswith(b"ray::CsxWorker"):
            pids.append(pid)
    return pids


def checkpoint(runs_dir: Path, job_id: int, step: int) -> dict[str, Any]:
    from training.checkpoint import checkpoint_path, load_checkpoint

    (folder,) = runs_dir.glob(f"job-{job_id}-*")
    return load_checkpoint(checkpoint_path(folder / "model", step))


def differences(reference: dict[str, Any], resumed: dict[str, Any]) -> list[str]:
    return [found for key in COMPARED
            for found in tensor_differences(reference.get(key), resumed.get(key), key)]


def first_differing_step(runs_dir: Path, reference: int, resumed: int) -> int | None:
    """The first checkpoint step at which the two runs' states differ: where to look first."""
    for step in range(CHECKPOINT_STEPS, MAX_STEPS + 1, CHECKPOINT_STEPS):
        if differences(checkpoint(runs_dir, reference, step), checkpoint(runs_dir, resumed, step)):
            return step
    return None


def tensor_differences(reference: Any, resumed: Any, path: str) -> list[str]:
    """Paths (`model.layer.weight`) where the two nested states differ: a tensor not
    bit-identical (torch.equal, dtype and shape included), a value or a key set unequal."""
    import torch

    if isinstance(reference, torch.Tensor) or isinstance(resumed, torch.Tensor):
        same = (isinstance(reference, torch.Tensor) and isinstance(resumed, torch.Tensor)
                and reference.dtype == resumed.dtype and torch.equal(reference, resumed))
        return [] if same else [path]
    if isinstance(reference, dict) and isinstance(resumed, dict):
        if reference.keys() != resumed.keys():
            return [f"{path} (keys)"]
        return [found for key in reference
                for found in tensor_differences(reference[key], resumed[key], f"{path}.{key}")]
    if isinstance(reference, (list, tuple)) and isinstance(resumed, (list, tuple)):
        if len(reference) != len(resumed):
            return [f"{path} (length)"]
        return [found for index, (a, b) in enumerate(zip(reference, resumed))
                for found in tensor_differences(a, b, f"{path}[{index}]")]
    return [] if reference == resumed else [path]


def count_tensors(state: Any) -> int:
    import torch

    if isinstance(state, torch.Tensor):
        return 1
    if isinstance(state, dict):
        return sum(count_tensors(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(count_tensors(value) for value in state)
    return 0


def time_to_recover(api: Api, job_id: int, recoveries: int, killed: float) -> float:
    """Seconds from the kill until the job's `recoveries`-th RECOVERING is followed by RUNNING
    (a fresh worker group has started from the last checkpoint). Read from the events, not the
    progress step: after an API kill the stored step is the last one reported before it."""
    def back() -> bool:
        events = api.statuses(job_id)
        return (events.count("RECOVERING") == recoveries
                and "RUNNING" in events[len(events) - events[::-1].index("RECOVERING"):])

    wait_for(back, JOB_DEADLINE_S, f"job {job_id} to run again after recovery {recoveries}")
    return round(time.monotonic() - killed, 1)


def run_recovery(backend: str, url: str, folder: Path) -> dict[str, Any]:
    """Both runs on the database at `url`; state under `folder`."""
    runs_dir = folder / "runs"
    env = {**os.environ, "CSX_DATABASE_URL": url, "CSX_RUNS_DIR": str(runs_dir),
           "CSX_CLUSTER_SIZE": "1", "CSX_MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}",
           "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    token = subprocess.run(
        [sys.executable, "-m", "service.cli", "token", "create", "--name", "recovery"],
        env=env, cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.strip().splitlines()[-1]
    server = ServerProcess(env, folder)
    server.start(timeout_s=180)
    api = Api(server, token)
    try:
        started = time.monotonic()
        reference = api.submit("uninterrupted")
        api.finished(reference)
        uninterrupted_s = round(time.monotonic() - started, 1)

        resumed = api.submit("killed twice")
        worker_step = wait_for(lambda: (s := api.step(resumed)) >= WORKER_KILL_AFTER and s,
                               JOB_DEADLINE_S, "training past the worker-kill step")
        (worker,) = wait_for(lambda: csx_worker_pids(server), 60, "the CsxWorker process")
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        worker_recover_s = time_to_recover(api, resumed, 1, killed)

        api_step = wait_for(lambda: (s := api.step(resumed)) >= API_KILL_AFTER and s,
                            JOB_DEADLINE_S, "training past the API-kill step")
        killed = time.monotonic()
        victims = server.kill_hard()
        wait_for(lambda: not any(is_alive(pid) for pid in victims), 60,
                 "the killed API and its Ray runtime to die")
        server.start(timeout_s=180)
        after_restart = api.job(resumed)["status"]
        api_recover_s = time_to_recover(api, resumed, 2, killed)
        done = api.finished(resumed)
        events = api.statuses(resumed)
        first_steps = api.first_steps_after_recoveries(resumed)
    finally:
        server.stop()

    want = checkpoint(runs_dir, reference, MAX_STEPS)
    got = checkpoint(runs_dir, resumed, MAX_STEPS)
    found = differences(want, got)
    before_kills = checkpoint(runs_dir, resumed, CHECKPOINT_STEPS)
    result = {
        "backend": backend, "max_steps": MAX_STEPS, "checkpoint_steps": CHECKPOINT_STEPS,
        "uninterrupted_s": uninterrupted_s,
        "worker_killed_at_step": worker_step, "worker_recover_s": worker_recover_s,
        "api_killed_at_step": api_step, "status_after_api_restart": after_restart,
        "api_recover_s": api_recover_s, "first_logged_step_after_each_recovery": first_steps,
        "status": done["status"], "restarts_in_worker_group": done["failures"],
        "events": events,
        "resumed": (done["status"] == "SUCCEEDED" and events.count("RECOVERING") == 2
                    and len(first_steps) == 2
                    and all(CHECKPOINT_STEPS < step <= MAX_STEPS for step in first_steps)),
        "compared": list(COMPARED), "tensors_compared": sum(count_tensors(want.get(k))
                                                            for k in COMPARED),
        "bit_identical": not found, "differences": found[:20],
        "rng_same_as_reference": not tensor_differences(want["rng"], got["rng"], "rng"),
        "rng_kept_across_kills": not tensor_differences(before_kills["rng"], got["rng"], "rng"),
        "first_differing_checkpoint_step": (first_differing_step(runs_dir, reference, resumed)
                                            if found else None),
    }
    print(f"{backend:>8}: a {MAX_STEPS}-step RigL job, worker SIGKILLed at step {worker_step} "
          f"(running again {worker_recover_s} s later), API SIGKILLed at step {api_step} "
          f"(running again {api_recover_s} s later, restart included): {done['status']}, "
          f"resumed {'yes' if result['resumed'] else 'NO'}; final checkpoint vs uninterrupted "
          f"({result['tensors_compared']} tensors of {', '.join(COMPARED)}): "
          f"{'bit-identical' if not found else f'{len(found)} DIFFER: ' + ', '.join(found[:5])}", flush=True)
    return result


def main() -> int:
    from reliability import database, recover  # bench/, this script's folder (it imports this)

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["sqlite"],
                        choices=["sqlite", "postgres"])
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep databases, runs and logs under this folder (one backend)")
    args = parser.parse_args()
    if args.keep is None:
        results = [recover(backend) for backend in args.backends]
    else:
        (backend,) = args.backends
        args.keep.mkdir(parents=True)
        with database(backend, args.keep) as url:
            results = [run_recovery(backend, url, args.keep)]
    print(json.dumps(results, indent=2))
    return 0 if all(r["resumed"] and r["bit_identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
