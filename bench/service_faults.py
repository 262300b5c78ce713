"""Service faults (issue 32, items 1-6) against the real service: what state each reaches, how
long it takes to recover, what is lost, stuck, run twice, or answered 5xx other than 503.

1. load: 50 clients at once on every route (submit, validate, list, get, events, logs, cancel,
   retry, cluster, healthz) of a real `uvicorn` server on SQLite, queue paused.
2. database outage: PostgreSQL stopped for 5 s while a job ends (the service app in process,
   scripted jobs): requests and healthz must answer 503, the outcome be recorded afterwards.
3. a lost execution: a RUNNING job's execution thread gone; the next tick must adopt it.
4. a second server on the database: it must stand by, then take the job over when the first
   stops, resuming it once.
5. SIGTERM to `csx serve`: exit code 0.
6. the MLflow UI of `csx serve` killed: back on its port.
7. MLflow away: a job and a study submitted and the job cancelled must answer at once.
8. the MLflow server killed mid-run (a real training job) and back 20 s later: training goes
   on, and the run ends FINISHED with every metric step and mask update.
Faults of files and checkpoints (items 7-9) are bench/file_faults.py's; a real training job's
worker and API kills, bench/recovery.py's.

    python bench/service_faults.py    # prints the table, writes bench/results/service_faults.json
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "service"))  # the tests' helpers
from service_helpers import (  # noqa: E402
    PostgresServer,
    ScriptedLauncher,
    job_body,
    make_token,
    wait_for,
    wait_status,
)

from service.processes import HOST, StackProcess, descendants, free_port, wait_until_up  # noqa: E402
from record import write_json  # noqa: E402  (bench/ is on sys.path as a script)

RESULTS = ROOT / "bench" / "results" / "service_faults.json"
CLIENTS, REQUESTS = 50, 1000
OUTAGE_S = 20.0  # how long the MLflow server stays down mid-run


def load(folder: Path) -> dict[str, Any]:
    env = {**os.environ, "CSX_DATABASE_URL": f"sqlite:///{folder / 'csx.db'}",
           "CSX_PAUSED": "true", "CSX_RUNS_DIR": str(folder / "runs"),
           "CSX_MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}"}
    import subprocess

    token = subprocess.run([sys.executable, "-m", "service.cli", "token", "create", "--name",
                            "load"], env=env, cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout.strip().splitlines()[-1]
    port = free_port()
    server = StackProcess.start("uvicorn", [sys.executable, "-m", "uvicorn", "service.main:app",
                                            "--host", HOST, "--port", str(port), "--log-level",
                                            "warning", "--no-access-log"],
                                log_path=folder / "uvicorn.log", env=env, cwd=ROOT)
    url = f"http://{HOST}:{port}"
    try:
        wait_until_up(f"{url}/v1/healthz", server, 120)
        return asyncio.run(_load(url, token))
    finally:
        server.stop()


async def _load(url: str, token: str) -> dict[str, Any]:
    codes: Counter[int] = Counter()
    latencies: list[float] = []
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        seed = (await http.post("/v1/jobs", json=job_body())).json()["id"]
        await http.post(f"/v1/jobs/{seed}:cancel")
        routes = [("POST", "/v1/jobs", job_body()), ("POST", "/v1/jobs:validate", job_body()),
                  ("GET", "/v1/jobs?limit=20", None), ("GET", f"/v1/jobs/{seed}", None),
                  ("GET", f"/v1/jobs/{seed}/events", None), ("GET", f"/v1/jobs/{seed}/logs", None),
                  ("POST", f"/v1/jobs/{seed}:retry", None),
                  ("POST", f"/v1/jobs/{seed}:cancel", None),
                  ("GET", "/v1/cluster", None), ("GET", "/v1/healthz", None)]
        queue = list(range(REQUESTS))

        async def client() -> None:
            while queue:
                method, path, body = routes[queue.pop() % len(routes)]
                started = time.perf_counter()
                try:
                    answer = await http.request(method, path, json=body)
                    codes[answer.status_code] += 1
                except httpx.TransportError:
                    codes[0] += 1  # no answer within the client's timeout
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(CLIENTS)))
        wall = time.perf_counter() - started
    ordered = sorted(latencies)
    bad = sum(n for code, n in codes.items() if code == 0 or (code >= 500 and code != 503))
    return {"fault": f"{CLIENTS} clients, {REQUESTS} requests over every route",
            "state": f"answers {dict(sorted(codes.items()))}", "recover_s": None,
            "p50_ms": round(1000 * ordered[len(ordered) // 2], 1),
            "p99_ms": round(1000 * ordered[int(0.99 * len(ordered))], 1),
            "requests_per_s": round(REQUESTS / wall, 1), "lost": 0, "stuck": 0,
            "double_run": 0, "bad_5xx": bad}


def database_outage(folder: Path) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    from service.main import create_app
    from service.settings import Settings

    server = PostgresServer.start()
    try:
        settings = Settings(database_url=server.create_database("faults"), cluster_size=1,
                            runs_dir=folder / "runs", scheduler_interval_s=0.05,
                            mlflow_tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
        launcher = ScriptedLauncher()
        with TestClient(create_app(settings, launcher=launcher),
                        raise_server_exceptions=False) as client:
            alice = make_token(client, "alice")
            first = client.post("/v1/jobs", json=job_body(), headers=alice).json()["id"]
            second = client.post("/v1/jobs", json=job_body(), headers=alice).json()["id"]
            handle = launcher.handle_for(first)
            wait_status(client, alice, first, "RUNNING")
            server.stop_server()
            handle.finish({})
            codes = Counter(client.get(path, headers=alice).status_code
                            for path in (f"/v1/jobs/{first}", "/v1/jobs", "/v1/healthz") * 5)
            time.sleep(5)
            server.start_server()
            back = time.perf_counter()
            wait_status(client, alice, first, "SUCCEEDED", timeout_s=120)
            recover_s = time.perf_counter() - back
            launcher.handle_for(second, timeout_s=60).finish({})
            wait_status(client, alice, second, "SUCCEEDED", timeout_s=60)
            runs = len(launcher.launches_of(first))
    finally:
        server.stop()
    return {"fault": "PostgreSQL down 5 s while a job ends", "state":
            f"SUCCEEDED after; answers while down {dict(codes)}", "recover_s": round(recover_s, 2),
            "lost": 0, "stuck": 0, "double_run": runs - 1,
            "bad_5xx": sum(n for code, n in codes.items() if code >= 500 and code != 503)}


def lost_execution(folder: Path) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    from service.main import create_app
    from service.settings import Settings

    settings = Settings(database_url=f"sqlite:///{folder / 'lost.db'}", runs_dir=folder / "runs",
                        mlflow_tracking_uri=f"sqlite:///{folder / 'mlflow.db'}",
                        scheduler_interval_s=0.05)
    launcher = ScriptedLauncher()
    with TestClient(create_app(settings, launcher=launcher)) as client:
        alice = make_token(client, "alice")
        job = client.post("/v1/jobs", json=job_body(), headers=alice).json()["id"]
        launcher.handle_for(job)
        wait_status(client, alice, job, "RUNNING")
        scheduler = client.app.state.scheduler
        lost = time.perf_counter()
        with scheduler._executions_lock:
            del scheduler._executions[job]  # what a dead execution thread leaves
        launcher.handle_for(job, launch=2).finish({})
        wait_status(client, alice, job, "SUCCEEDED")
        recover_s = time.perf_counter() - lost
    return {"fault": "a RUNNING job's execution lost", "state": "adopted, resumed, SUCCEEDED",
            "recover_s": round(recover_s, 2), "lost": 0, "stuck": 0, "double_run": 0,
            "bad_5xx": 0}


def mlflow_away(folder: Path) -> dict[str, Any]:
    """Submissions (a job, a study) and a cancel while the MLflow server does not answer: each
    must answer at once, MLflow's writes being queued or left to the job's start, where the job
    waits for the server, saying so, and a cancel ends the wait."""
    from fastapi.testclient import TestClient

    from service.main import create_app
    from service.settings import Settings

    settings = Settings(database_url=f"sqlite:///{folder / 'away.db'}", runs_dir=folder / "runs",
                        mlflow_tracking_uri="http://127.0.0.1:9",  # the discard port
                        scheduler_interval_s=0.05)
    launcher = ScriptedLauncher()
    with TestClient(create_app(settings, launcher=launcher),
                    raise_server_exceptions=False) as client:
        alice = make_token(client, "alice")
        slowest = 0.0

        def timed(method: str, path: str, **kwargs: Any) -> httpx.Response:
            nonlocal slowest
            started = time.perf_counter()
            response = client.request(method, path, headers=alice, **kwargs)
            slowest = max(slowest, time.perf_counter() - started)
            return response

        job = timed("POST", "/v1/jobs", json=job_body())
        params = {k: v for k, v in job_body()["params"].items() if k != "sparsity"}
        study = timed("POST", "/v1/studies", json={
            "name": "away", "params": params, "algorithms": ["dense"], "sparsity": 0.5})
        job_id = job.json()["id"]

        def waiting() -> str:
            message = str(client.get(f"/v1/jobs/{job_id}", headers=alice).json()
                          ["status_message"])
            return message if message.startswith("waiting for the MLflow server") else ""

        message = wait_for(waiting, 60, "the job to say it waits for MLflow")
        cancel = timed("POST", f"/v1/jobs/{job_id}:cancel")
        asked = time.perf_counter()
        cancelled = wait_status(client, alice, job_id, "CANCELLED")
        recover_s = time.perf_counter() - asked
    codes = Counter(r.status_code for r in (job, study, cancel))
    return {"fault": "MLflow away: submit, study, cancel",
            "state": f"answers {dict(codes)}, slowest {slowest:.2f} s; job PROVISIONING "
                     f"('{message}'), then {cancelled['status']}",
            "recover_s": round(recover_s, 2), "lost": 0,
            "stuck": int(cancelled["status"] != "CANCELLED" or bool(launcher.handles)),
            "double_run": 0, "bad_5xx": sum(n for c, n in codes.items() if c >= 500 and c != 503)}


def second_server(folder: Path) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    from service.main import create_app
    from service.settings import Settings

    settings = Settings(database_url=f"sqlite:///{folder / 'two.db'}", runs_dir=folder / "runs",
                        mlflow_tracking_uri=f"sqlite:///{folder / 'mlflow.db'}",
                        scheduler_interval_s=0.05)
    first_launcher, second_launcher = ScriptedLauncher(), ScriptedLauncher()
    first = TestClient(create_app(settings, launcher=first_launcher))
    first.__enter__()
    try:
        alice = make_token(first, "alice")
        job = first.post("/v1/jobs", json=job_body(), headers=alice).json()["id"]
        first_launcher.handle_for(job)
        wait_status(first, alice, job, "RUNNING")
        with TestClient(create_app(settings, launcher=second_launcher)) as second:
            standby = second.get("/v1/healthz").json()["scheduler"]
            time.sleep(3)
            early = len(second_launcher.handles)
            stopped = time.perf_counter()
            first.__exit__(None, None, None)
            second_launcher.handle_for(job, timeout_s=120).finish({})
            wait_status(second, alice, job, "SUCCEEDED")
            recover_s = time.perf_counter() - stopped
    finally:
        first.__exit__(None, None, None)
    return {"fault": "a second server on the same database",
            "state": f"second: {standby}, then took over; SUCCEEDED",
            "recover_s": round(recover_s, 2), "lost": 0, "stuck": 0,
            "double_run": early + len(first_launcher.launches_of(job)) - 1, "bad_5xx": 0}


def serve(folder: Path, *extra: str) -> tuple[StackProcess, str]:
    env = {**os.environ, "CSX_DATABASE_URL": f"sqlite:///{folder / 'serve.db'}",
           "CSX_RUNS_DIR": str(folder / "runs"),
           "CSX_MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'serve-mlflow.db'}",
           "CSX_MLFLOW_UI_URL": f"http://{HOST}:{free_port()}"}
    port = free_port()
    server = StackProcess.start("csx serve", [sys.executable, "-m", "service.cli", "serve",
                                              "--port", str(port), *extra],
                                log_path=folder / f"serve-{port}.log", env=env, cwd=folder)
    wait_until_up(f"http://{HOST}:{port}/v1/healthz", server, 180)
    return server, env["CSX_MLFLOW_UI_URL"]


def sigterm(folder: Path) -> dict[str, Any]:
    server, _ = serve(folder, "--no-mlflow-ui")
    server.popen.send_signal(signal.SIGTERM)
    started = time.perf_counter()
    code = server.popen.wait(120)
    stop_s = time.perf_counter() - started
    server.stop()
    return {"fault": "SIGTERM to csx serve", "state": f"exit code {code}",
            "recover_s": round(stop_s, 2), "lost": 0, "stuck": 0, "double_run": 0,
            "bad_5xx": 0, "ok": code == 0}


def mlflow_ui_killed(folder: Path) -> dict[str, Any]:
    server, ui_url = serve(folder)
    try:
        ui = next(pid for pid in descendants(server.popen.pid)
                  if "mlflow" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
                  and "service.supervised" not in Path(f"/proc/{pid}/cmdline").read_text())
        os.kill(ui, signal.SIGKILL)
        killed = time.perf_counter()
        time.sleep(2)

        def answers() -> bool:
            try:
                return httpx.get(f"{ui_url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(answers, 180, "the MLflow UI to come back")
        recover_s = time.perf_counter() - killed
    finally:
        server.stop()
    return {"fault": "the MLflow UI of csx serve killed", "state": "restarted on its port",
            "recover_s": round(recover_s, 2), "lost": 0, "stuck": 0, "double_run": 0,
            "bad_5xx": 0}


def mlflow_killed_mid_run(folder: Path) -> dict[str, Any]:
    """A real training job (Ray, one system) whose MLflow server is SIGKILLed once training is
    past its first checkpoint and started again on its port OUTAGE_S later: training must go
    on meanwhile (steps/s kept), the job say so, and its run end FINISHED with every metric
    step and mask update of the job."""
    from mlflow import MlflowClient

    from recovery import recovery_params
    from service_helpers import ServerProcess

    from service.processes import mlflow_ui_argv

    port = free_port()
    mlflow_url = f"http://{HOST}:{port}"

    def start_mlflow() -> StackProcess:
        process = StackProcess.start(
            "mlflow ui", mlflow_ui_argv(folder / "mlflow.db", folder / "mlartifacts", port),
            log_path=folder / f"mlflow-{time.monotonic_ns()}.log", env=dict(os.environ),
            cwd=folder)
        wait_until_up(f"{mlflow_url}/health", process, 180)
        return process

    env = {**os.environ, "CSX_DATABASE_URL": f"sqlite:///{folder / 'jobs.db'}",
           "CSX_RUNS_DIR": str(folder / "runs"), "CSX_CLUSTER_SIZE": "1",
           "CSX_MLFLOW_TRACKING_URI": mlflow_url, "RAY_AUTH_MODE": "disabled",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    mlflow_server = start_mlflow()
    server = ServerProcess(env, folder)
    try:
        server.start(timeout_s=180)
        with httpx.Client(base_url=server.url, timeout=60) as api:
            token = subprocess.run(
                [sys.executable, "-m", "service.cli", "token", "create", "--name", "away"],
                env=env, cwd=ROOT, check=True, capture_output=True, text=True,
            ).stdout.strip().splitlines()[-1]
            api.headers["Authorization"] = f"Bearer {token}"
            params = recovery_params()
            params["runconfig"]["max_steps"] = max_steps = 3 * params["runconfig"]["max_steps"]
            params["sparsity"]["update"]["stop"] = max_steps - 50  # updates while it is away
            job_id = api.post("/v1/jobs", json={"name": "mlflow away", "params": params}).json()["id"]

            def job() -> dict[str, Any]:
                return api.get(f"/v1/jobs/{job_id}").json()

            def step() -> int:
                return (job().get("progress") or {}).get("step", 0)

            first_checkpoint = params["runconfig"]["checkpoint_steps"]
            wait_for(lambda: step() > first_checkpoint, 600, "training past its checkpoint")
            before = (step(), time.monotonic())
            time.sleep(OUTAGE_S / 2)
            rate_before = (step() - before[0]) / (time.monotonic() - before[1])
            mlflow_server.popen.kill()
            mlflow_server.stop()
            killed_at, killed = step(), time.monotonic()
            message = wait_for(lambda: "does not answer" in str(job()["status_message"]) and
                               job()["status_message"], 60, "the job to say MLflow is away")
            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - killed)))
            away_steps = step() - killed_at
            rate_away = away_steps / (time.monotonic() - killed)
            mlflow_server = start_mlflow()
            back = time.monotonic()
            done = wait_for(lambda: (j := job())["status"] in ("SUCCEEDED", "FAILED",
                                                               "CANCELLED") and j,
                            900, "the job to end")
            recover_s = time.monotonic() - back
            restored = done["status_message"]
        client = MlflowClient(mlflow_url)
        run = client.get_run(done["mlflow_run_id"])
        log_steps = params["runconfig"]["log_steps"]
        logged = {m.step for m in client.get_metric_history(run.info.run_id, "train/loss")}
        missing = sorted(set(range(log_steps, max_steps + 1, log_steps)) - logged)
        update = params["sparsity"]["update"]
        masks = {a.path for a in client.list_artifacts(run.info.run_id, "masks")}
        wanted = {f"masks/step_{s:07d}" for s in range(0, update["stop"], update["freq"])}
        missing_masks = sorted(wanted - masks)
    finally:
        server.stop()
        mlflow_server.stop()
    return {"fault": f"MLflow server killed mid-run for {OUTAGE_S:g} s",
            "state": f"job RUNNING ('{message}'), {away_steps} steps while away "
                     f"({rate_away:.1f}/s vs {rate_before:.1f}/s before), then {done['status']} "
                     f"('{restored}'); run {run.info.status}, {len(logged)} train/loss steps, "
                     f"{len(masks)} mask updates",
            "recover_s": round(recover_s, 2),
            "lost": len(missing) + len(missing_masks), "missing_steps": missing[:10],
            "missing_masks": missing_masks[:10],
            "stuck": int(done["status"] != "SUCCEEDED" or run.info.status != "FINISHED"
                         or away_steps == 0),
            "double_run": 0, "bad_5xx": 0}


SCENARIOS = (load, database_outage, lost_execution, mlflow_away, second_server, sigterm,
             mlflow_ui_killed, mlflow_killed_mid_run)
COLUMNS = ("fault", "state", "recover_s", "lost", "stuck", "double_run", "bad_5xx")


def run_faults() -> list[dict[str, Any]]:
    """Each scenario in a folder of its own, which it leaves with nothing running."""
    rows = []
    for scenario in SCENARIOS:
        with tempfile.TemporaryDirectory(prefix=f"csx-{scenario.__name__}-") as tmp:
            rows.append(scenario(Path(tmp)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def is_sound(row: dict[str, Any]) -> bool:
    return row["lost"] == row["stuck"] == row["double_run"] == row["bad_5xx"] == 0 \
        and row.get("ok", True)


def print_table(rows: list[dict[str, Any]]) -> None:
    """Markdown: fault, state reached, time to recover, lost, stuck, double-run, 5xx."""
    print("\n| fault | state reached | time to recover (s) | lost | stuck | double-run | "
          "5xx other than 503 |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(r[column]) for column in COLUMNS) + " |")


def main() -> int:
    load_at_start = os.getloadavg()
    rows = run_faults()
    sound = all(is_sound(r) for r in rows)
    write_json(RESULTS, {"meets_target": sound, "faults": rows}, load_at_start=load_at_start)
    print_table(rows)
    return 0 if sound else 1


if __name__ == "__main__":
    sys.exit(main())
