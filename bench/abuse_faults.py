"""Issue 47's faults and abuse against the service: what state each reaches, how long it takes
to recover, what is lost, stuck, run twice, or answered 5xx other than 503.

1. MLflow squatting: Bob creates `alice/squat` on a basic-auth MLflow server before Alice's
   jobs log there; he must be refused her runs (read and delete).
2. 8 clients on a finished study's report and report.png; variant names MLflow refuses as
   metric keys (`rigl #1`, `a/../b`).
3. An upgrade from the first release: a revision-0001 database with a running, a queued and a
   failed job of the first release's spec layout.
4. One of two nodes lost under a 2-system job, a 1-system job queued behind it.
5. Cancel-all: 5,000 queued jobs cancelled by 20 clients while the scheduler starts them.
6. 500 wrong tokens from one client.
7. Odd input: 8,000- and 64,000-digit ids on every id route, an admin listing the jobs of a
   user whose token row was deleted, names over 200 characters on PostgreSQL.
8. 45 readers of a 524 MB job log at once (a real uvicorn), healthz polled meanwhile.
9. A server killed after MLflow opened a study's parent run and before it was recorded, and
   checkpoint writes killed mid-write: one parent run, the temporary files gone after a start.
The 50-client load over every route on both databases is bench/route_load.py's.

    python bench/abuse_faults.py    # prints the table, writes bench/results/abuse_faults.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from record import write_json  # bench/, this script's folder

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "service"))  # the tests' helpers
from service_helpers import (  # noqa: E402
    PostgresServer,
    ScriptedLauncher,
    job_body,
    make_token,
    start_auth_mlflow,
    wait_for,
    wait_status,
)

RESULTS = ROOT / "bench" / "results" / "abuse_faults.json"
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
READS_EACH = 10  # log readers: each reads the tail this many times, one after another


def _bad(codes: Counter[int]) -> int:
    return sum(n for code, n in codes.items() if code >= 500 and code != 503)


def _app(folder: Path, launcher: Any = None, **settings: Any) -> Any:
    """The service in process on a fresh SQLite database of `folder`, four 1-CPU nodes."""
    from dataclasses import replace

    from fastapi.testclient import TestClient

    from service.cluster import machine_summary
    from service.main import create_app
    from service.settings import Settings

    options = {"database_url": f"sqlite:///{folder / 'csx.db'}", "runs_dir": folder / "runs",
               "mlflow_tracking_uri": f"sqlite:///{folder / 'mlflow.db'}",
               "scheduler_interval_s": 0.05, "cluster_size": 4, **settings}
    service = Settings(**options)
    if "cluster_size" not in settings:
        four = replace(machine_summary(4), nodes=4, cpus_per_system=1.0)
        service.read_cluster_from(lambda: four)
    return TestClient(create_app(service, launcher=launcher or ScriptedLauncher()),
                      raise_server_exceptions=False)


def mlflow_squat(folder: Path) -> dict[str, Any]:
    from service.mlflow_auth import CREDENTIALS_ENV

    admin = ("csx-service", "admin-password-for-the-bench")
    server, url = start_auth_mlflow(folder, admin)
    saved = {name: os.environ.get(name) for name in CREDENTIALS_ENV}
    try:
        launcher = ScriptedLauncher()
        launcher.create_runs = True
        with _app(folder, launcher, mlflow_tracking_uri=url, mlflow_ui_url=url,
                  mlflow_admin_username=admin[0], mlflow_admin_password=admin[1]) as client:
            alice, bob = make_token(client, "alice"), make_token(client, "bob")
            bobs = client.get("/v1/mlflow/credentials", headers=bob).json()
            as_bob = (bobs["username"], bobs["password"])
            api = f"{url}/api/2.0/mlflow"
            squatted = httpx.post(f"{api}/experiments/create", json={"name": "alice/squat"},
                                  auth=as_bob, timeout=30).json()["experiment_id"]
            jobs = [client.post("/v1/jobs", json=job_body(experiment="squat"),
                                headers=alice).json()["id"] for _ in range(2)]
            runs = [wait_status(client, alice, job, "RUNNING", timeout_s=120)["mlflow_run_id"]
                    for job in jobs]
            codes = Counter()
            for run in runs:
                codes[httpx.get(f"{api}/runs/get", params={"run_id": run}, auth=as_bob,
                                timeout=30).status_code] += 1
                codes[httpx.post(f"{api}/runs/delete", json={"run_id": run}, auth=as_bob,
                                 timeout=30).status_code] += 1
            in_squat = httpx.post(f"{api}/runs/search", json={"experiment_ids": [squatted]},
                                  auth=admin, timeout=30).json().get("runs", [])
    finally:
        server.stop()
        for name, value in saved.items():  # the app set the admin account in this process
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return {"fault": "Bob creates alice/squat before Alice's jobs (MLflow basic-auth)",
            "state": f"Alice's 2 runs in the service's experiment, {len(in_squat)} in Bob's; "
                     f"Bob's reads and deletes answered {dict(codes)}",
            "recover_s": None, "lost": 0, "stuck": 0, "double_run": 0, "bad_5xx": _bad(codes),
            "ok": set(codes) == {403} and not in_squat}


def _finished_study(client: Any, alice: dict[str, str], launcher: ScriptedLauncher,
                    names: list[str]) -> int:
    variants = [{"name": name, "sparsity": {"algorithm": "static", "sparsity": 0.5}}
                for name in names]
    study = client.post("/v1/studies", json={"name": "bench", "params": job_body()["params"],
                                             "variants": variants}, headers=alice).json()
    for i, job in enumerate(study["jobs"]):
        launcher.handle_for(job["id"]).finish({
            "final_eval_perplexity": 20.0 + i, "speedup_vs_dense": 1.5,
            "eval_history": [{"step": s, "loss": 3.0, "perplexity": 30.0 - s + i}
                             for s in (2, 6, 10)]})
        wait_status(client, alice, job["id"], "SUCCEEDED")
    return study["id"]


def study_reports(folder: Path) -> dict[str, Any]:
    launcher = ScriptedLauncher()
    with _app(folder, launcher) as client:
        alice = make_token(client, "alice")
        plain = _finished_study(client, alice, launcher, ["dense-a", "static-b", "set-c", "rigl-d"])
        odd = _finished_study(client, alice, launcher, ["rigl #1", "a/../b"])
        started = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            codes = Counter(pool.map(lambda i: client.get(
                f"/v1/studies/{plain}/report" + (".png" if i % 2 else ""),
                headers=alice).status_code, range(32)))
        wall = time.perf_counter() - started
        codes.update(client.get(f"/v1/studies/{odd}/{path}", headers=alice).status_code
                     for path in ("report", "report.png") * 4)
    return {"fault": "8 clients on a finished study's report + report.png; variant names "
                     "'rigl #1', 'a/../b'",
            "state": f"answers {dict(codes)}; the 32 concurrent in {wall:.1f} s",
            "recover_s": None, "lost": 0, "stuck": 0, "double_run": 0, "bad_5xx": _bad(codes),
            "ok": set(codes) == {200}}


def first_release_upgrade(folder: Path) -> dict[str, Any]:
    from test_service_upgrade import _first_release_database

    from service.db import upgrade_database

    url = f"sqlite:///{folder / 'csx.db'}"
    secret = _first_release_database(url)
    upgrade_database(url)
    alice = {"Authorization": f"Bearer {secret}"}
    launcher = ScriptedLauncher()
    started = time.perf_counter()
    with _app(folder, launcher) as client:
        for job in (1, 2):
            wait_status(client, alice, job, "RUNNING", timeout_s=120)
        recover_s = time.perf_counter() - started
        retry = client.post("/v1/jobs/3:retry", headers=alice).status_code
        statuses = [client.get(f"/v1/jobs/{i}", headers=alice).json()["status"]
                    for i in (1, 2, 3)]
    return {"fault": "upgrade from the first release (revision 0001, its spec layout)",
            "state": f"running job resumed, queued one started: {statuses[:2]}; retry of the "
                     f"failed one {retry}", "recover_s": round(recover_s, 2), "lost": 0,
            "stuck": 0, "double_run": 0, "bad_5xx": int(retry >= 500), "ok": retry == 202}


def lost_node(folder: Path) -> dict[str, Any]:
    from dataclasses import replace

    launcher = ScriptedLauncher()
    with _app(folder, launcher) as client:
        settings = client.app.state.settings
        two = replace(settings.cluster(), systems=2, nodes=2)
        settings.read_cluster_from(lambda: two)
        alice = make_token(client, "alice")
        big = client.post("/v1/jobs", json=job_body(num_csx=2), headers=alice).json()["id"]
        handle = launcher.handle_for(big)
        wait_status(client, alice, big, "RUNNING")
        one = replace(two, systems=1, nodes=1)
        settings.read_cluster_from(lambda: one)
        lost = time.perf_counter()
        handle.kwargs["progress"]({"event": "recovering", "failures": 1, "error": "node lost"})
        small = client.post("/v1/jobs", json=job_body(), headers=alice).json()["id"]
        wait_status(client, alice, small, "RUNNING", timeout_s=60)
        recover_s = time.perf_counter() - lost
        big_now = client.get(f"/v1/jobs/{big}", headers=alice).json()["status"]
        free = client.get("/v1/cluster", headers=alice).json()["free"]
    return {"fault": "one of two nodes lost under a 2-system job",
            "state": f"2-system job {big_now}, 1-system job RUNNING on the node left, free {free}",
            "recover_s": round(recover_s, 2), "lost": 0, "stuck": 0, "double_run": 0,
            "bad_5xx": 0, "ok": big_now == "QUEUED" and free == 0}


def cancel_all(folder: Path, jobs: int = 5000) -> dict[str, Any]:
    from service import crud
    from service.jobs import job_fields
    from service.schemas import JobCreate
    from service.states import HOLDING

    with _app(folder, ScriptedLauncher(), paused=True) as client:
        alice = make_token(client, "alice")
        job_in = JobCreate.model_validate(job_body())
        fields = job_fields(job_in, job_in.params, client.app.state.settings, name="queued")
        with client.app.state.sessionmaker() as session:
            owner = crud.get_caller(session, secret=alice["Authorization"].split()[1])
            ids = [crud.add_job(session, owner=owner, **fields)["id"] for _ in range(jobs)]
            session.commit()
        client.app.state.settings.paused = False
        client.app.state.scheduler.wake()
        pending = list(ids)
        lock = threading.Lock()
        codes: Counter[int] = Counter()

        def canceller() -> None:
            while True:
                with lock:
                    if not pending:
                        return
                    job = pending.pop()
                codes[client.post(f"/v1/jobs/{job}:cancel", headers=alice).status_code] += 1

        started = time.perf_counter()
        threads = [threading.Thread(target=canceller) for _ in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        def ended() -> bool:
            with client.app.state.sessionmaker() as session:
                return not crud.jobs_in(session, statuses=HOLDING)

        wait_for(ended, 120, "every cancelled job to end")
        recover_s = time.perf_counter() - started
        with client.app.state.sessionmaker() as session:
            from sqlalchemy import func, select

            from service.models import Job

            states = dict(session.execute(select(Job.status, func.count()).group_by(Job.status))
                          .all())
    stuck = sum(n for status, n in states.items() if status not in TERMINAL)
    return {"fault": f"cancel-all: {jobs} queued jobs, 20 clients, scheduler starting them",
            "state": f"answers {dict(codes)}; jobs {states}", "recover_s": round(recover_s, 2),
            "lost": 0, "stuck": stuck, "double_run": 0, "bad_5xx": _bad(codes),
            "ok": set(codes) == {202} and stuck == 0}


def token_guessing(folder: Path) -> dict[str, Any]:
    with _app(folder, paused=True) as client:
        make_token(client, "alice")
        started = time.perf_counter()
        answers = [client.get("/v1/jobs", headers={"Authorization": f"Bearer csx_guess{i}"})
                   for i in range(500)]
        wall = time.perf_counter() - started
    codes = Counter(a.status_code for a in answers)
    first_429 = next((i for i, a in enumerate(answers) if a.status_code == 429), None)
    retry_after = answers[-1].headers.get("Retry-After")
    return {"fault": "500 wrong tokens from one client",
            "state": f"answers {dict(codes)} in {wall:.1f} s; 429 from guess {first_429}, "
                     f"Retry-After {retry_after} s", "recover_s": None, "lost": 0, "stuck": 0,
            "double_run": 0, "bad_5xx": _bad(codes), "ok": codes[401] == 10}


def odd_input(folder: Path) -> dict[str, Any]:
    from sqlalchemy import text

    codes: Counter[int] = Counter()
    with _app(folder, paused=True) as client:
        alice, admin = make_token(client, "alice"), make_token(client, "root", admin=True)
        bob = make_token(client, "bob")
        client.post("/v1/jobs", json=job_body(), headers=bob)
        for digits in (8000, 64000):
            big = "9" * digits
            for method, path in (("GET", f"/v1/jobs/{big}"), ("GET", f"/v1/jobs/{big}/events"),
                                 ("GET", f"/v1/jobs/{big}/logs"),
                                 ("POST", f"/v1/jobs/{big}:cancel"),
                                 ("POST", f"/v1/jobs/{big}:retry"),
                                 ("GET", f"/v1/studies/{big}"),
                                 ("GET", f"/v1/studies/{big}/report")):
                codes[client.request(method, path, headers=alice).status_code] += 1
        with client.app.state.sessionmaker() as session:
            session.execute(text("PRAGMA foreign_keys=OFF"))
            session.execute(text("DELETE FROM tokens WHERE name = 'bob'"))
            session.commit()
        codes[client.get("/v1/jobs", headers=admin).status_code] += 1
    server = PostgresServer.start()
    (folder / "pg").mkdir()
    try:
        with _app(folder / "pg", paused=True,
                  database_url=server.create_database("odd")) as client:
            alice = make_token(client, "alice")
            body = {"name": "s" * 200, "params": job_body()["params"],
                    "variants": [{"name": "v" * 200, "sparsity": 0.5}]}
            codes[client.post("/v1/studies", json=body, headers=alice).status_code] += 1
            long = job_body(runconfig={"max_steps": 10, "mlflow_experiment": "e" * 300})
            codes[client.post("/v1/jobs", json=long, headers=alice).status_code] += 1
    finally:
        server.stop()
    return {"fault": "ids of 8,000/64,000 digits, a deleted user's jobs listed, 200+ "
                     "character names on PostgreSQL",
            "state": f"answers {dict(codes)}", "recover_s": None, "lost": 0, "stuck": 0,
            "double_run": 0, "bad_5xx": _bad(codes), "ok": not _bad(codes)}


def log_readers(folder: Path, readers: int = 45, log_mb: int = 524) -> dict[str, Any]:
    import asyncio

    from route_load import api_server, large_log  # bench/, this script's folder

    url = f"sqlite:///{folder / 'csx.db'}"
    with api_server(url, folder, job_s=0.5) as (base, tokens, _):
        alice = {"Authorization": f"Bearer {tokens['alice']}"}
        job = httpx.post(f"{base}/v1/jobs", json=job_body(), headers=alice, timeout=30).json()
        wait_for(lambda: httpx.get(f"{base}/v1/jobs/{job['id']}", headers=alice, timeout=30)
                 .json()["status"] in TERMINAL, 120, "the job to end")
        large_log(folder, url, job["id"], log_mb)

        async def run() -> tuple[Counter[int], list[float], float]:
            async with httpx.AsyncClient(base_url=base, headers=alice, timeout=60) as http:
                async def read() -> list[int]:
                    return [(await http.get(f"/v1/jobs/{job['id']}/logs")).status_code
                            for _ in range(READS_EACH)]

                async def health(stop: asyncio.Event) -> list[float]:
                    took = []
                    while not stop.is_set():
                        started = time.perf_counter()
                        await http.get("/v1/healthz")
                        took.append(time.perf_counter() - started)
                        await asyncio.sleep(0.05)
                    return took

                stop = asyncio.Event()
                poller = asyncio.create_task(health(stop))
                started = time.perf_counter()
                codes = Counter(code for reads in await asyncio.gather(
                    *(read() for _ in range(readers))) for code in reads)
                wall = time.perf_counter() - started
                stop.set()
                return codes, await poller, wall

        codes, health_s, wall = asyncio.run(run())
    return {"fault": f"{readers} readers at once of a {log_mb} MB job log's last 1,000 lines "
                     f"({READS_EACH} reads each)",
            "state": f"answers {dict(codes)} in {wall:.1f} s; healthz max "
                     f"{1000 * max(health_s):.0f} ms over {len(health_s)} polls",
            "recover_s": None, "lost": 0, "stuck": 0, "double_run": 0, "bad_5xx": _bad(codes),
            "ok": set(codes) == {200}}


def killed_mid_write(folder: Path) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    from service.experiments import owned_experiment_id
    from service.models import Study
    from service.studies import open_parent_run

    launcher = ScriptedLauncher()
    model = folder / "runs" / "job-99-00aa11bb" / "model"
    temporary = [model / f".checkpoint_{step}.mdl.x{step}.tmp" for step in range(8)]
    with _app(folder, launcher, paused=True) as client:
        model.mkdir(parents=True)
        for path in temporary:  # what 8 killed checkpoint writes leave
            path.write_bytes(b"")
        settings = client.app.state.settings
        alice = make_token(client, "alice")
        params = {k: v for k, v in job_body()["params"].items() if k != "sparsity"}
        study = client.post("/v1/studies", json={"name": "s", "params": params,
                                                 "algorithms": ["dense", "static"],
                                                 "sparsity": 0.5}, headers=alice).json()
        with client.app.state.sessionmaker() as session:  # what the killed server did
            row = session.get(Study, study["id"])
            experiment = owned_experiment_id(client.app.state.sessionmaker, settings,
                                             owner_id=row.owner_id, owner_name="alice",
                                             experiment=row.experiment)
            open_parent_run(settings, row, experiment)
        left_over = sum(path.exists() for path in temporary)
    started = time.perf_counter()
    with _app(folder, launcher) as client:  # the next start
        for job in study["jobs"]:
            launcher.handle_for(job["id"], timeout_s=120)
        recover_s = time.perf_counter() - started
        parents = MlflowClient(client.app.state.settings.mlflow_tracking_uri).search_runs(
            [experiment], "tags.`csx.role` = 'study'")
    remaining = sum(path.exists() for path in temporary)
    return {"fault": "killed while a study's parent run opened; 8 checkpoint writes killed",
            "state": f"{len(parents)} parent run(s); temporary files {left_over} -> {remaining}",
            "recover_s": round(recover_s, 2), "lost": 0, "stuck": remaining,
            "double_run": len(parents) - 1, "bad_5xx": 0,
            "ok": len(parents) == 1 and remaining == 0}


SCENARIOS: tuple[Callable[[Path], dict[str, Any]], ...] = (
    mlflow_squat, study_reports, first_release_upgrade, lost_node, cancel_all, token_guessing,
    odd_input, log_readers, killed_mid_write)


def run_faults() -> list[dict[str, Any]]:
    """Each scenario in a folder of its own, which it leaves with nothing running."""
    rows = []
    for scenario in SCENARIOS:
        with tempfile.TemporaryDirectory(prefix=f"csx-{scenario.__name__}-") as tmp:
            started = time.perf_counter()
            rows.append(scenario(Path(tmp)))
            rows[-1]["scenario_s"] = round(time.perf_counter() - started, 1)
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    import service_faults  # bench/, this script's folder

    load_at_start = os.getloadavg()
    rows = run_faults()
    sound = all(service_faults.is_sound(row) for row in rows)
    write_json(RESULTS, {"meets_target": sound, "faults": rows}, load_at_start=load_at_start)
    service_faults.print_table(rows)
    return 0 if sound else 1


if __name__ == "__main__":
    sys.exit(main())
