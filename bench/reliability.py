"""Reliability of the job API under load, on SQLite and on PostgreSQL, with several API processes.

Per backend: a fresh database (SQLite WAL file, or a private PostgreSQL server started from the
Debian packages by tests/service/pg.sh), migrated once, and API_PROCESSES `uvicorn
service.main:app` processes on it with a paused queue (jobs are stored and queued, none runs).
Then, at once:

* 1,000 submissions from 50 clients, each with its own Idempotency-Key, spread over the API
  processes; a client whose request fails (connection lost, 5xx) sends it again, same key, to
  the next process, as a careful client would;
* hostile uploads: a 10 MB YAML of short keys and a 10,000-deep YAML, back to back from two
  clients, while a third polls /v1/healthz;
* an API kill: once 40% of the submissions are answered, one API process is SIGKILLed.

Counted afterwards from the database: accepted (201 answers), lost (a 201 whose job is not
stored), duplicated (more jobs than submissions), 5xx answers; req/s and p50/p99 latency of
submissions (retries included in the latency), p50/p99/max of healthz. Writes
bench/results/reliability.json.

    python bench/reliability.py             # 1000 submissions, 50 clients, both backends
    python bench/reliability.py --quick     # 200 submissions, 20 clients
    python bench/reliability.py --backends sqlite

Then, per backend, on a fresh database, bench/recovery.py: a real training job with its
CsxWorker process SIGKILLed mid-run and later its API process (and Ray) SIGKILLed and restarted;
the resumed job's final checkpoint must be bit-identical to an uninterrupted run's
(`--no-recovery` skips it).

Then, per backend, bench/route_load.py: 50 clients over every route for 60 s with the
scheduler running (scripted training), then every job cancelled (`--no-routes` skips it).

Then the fault table (issues 32 and 47; `--no-faults` skips it): bench/service_faults.py's
scenarios (load on every route, a database outage, a lost execution, a second server, SIGTERM,
the MLflow UI killed), bench/file_faults.py's (a full disk, damaged checkpoints, planted
links, special files) and bench/abuse_faults.py's (MLflow experiment squatting, concurrent
study reports, an upgrade from the first release, a lost node, cancel-all, token guessing,
odd input, 45 log readers, a kill while runs and checkpoints are written), one row each:
fault -> state reached, time to recover, lost, stuck, double-run, 5xx other than 503.

Bounded: after --budget-s (default an hour) the run stops where it is; each part stops what it
started on the way out (its servers and their process groups), so nothing is left running.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from sqlalchemy import create_engine, func, select

from record import write_json  # bench/, this script's folder
import route_load  # bench/, this script's folder
from recovery import run_recovery
from service.db import upgrade_database
from service.processes import HOST, StackProcess, free_port, wait_until_up
from service.models import Job

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "reliability.json"
API_PROCESSES = 2
KILL_AT = 0.4  # share of submissions answered when one API process is killed
TRIES = 5
BODY = {"params": {"train_input": {"batch_size": 8, "max_sequence_length": 16},
                   "model": {"preset": "tiny"},
                   "sparsity": {"algorithm": "rigl", "sparsity": 0.9, "update": {"freq": 10}},
                   "runconfig": {"max_steps": 100}}}
HOSTILE = {
    "10 MB of short keys": b"".join(b"k%d: 1\n" % i for i in range(1_100_000))[:9_900_000],
    "10,000-deep YAML": b"[" * 10_000 + b"]" * 10_000,
}


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) \
        if ordered else None


@contextmanager
def database(backend: str, folder: Path) -> Iterator[str]:
    """A fresh, migrated database URL for `backend`."""
    if backend == "sqlite":
        url = f"sqlite:///{folder / 'csx.db'}"
        upgrade_database(url)
        yield url
        return
    sys.path.insert(0, str(ROOT / "tests" / "service"))  # the tests' private server helper
    from service_helpers import PostgresServer

    server = PostgresServer.start()
    try:
        url = server.create_database("reliability").replace(
            "postgresql://", "postgresql+psycopg://")
        upgrade_database(url)
        yield url
    finally:
        server.stop()


@contextmanager
def api_processes(url: str, folder: Path, count: int) -> Iterator[tuple[list[StackProcess],
                                                                         list[str], str]]:
    env = {**os.environ, "CSX_DATABASE_URL": url, "CSX_PAUSED": "true",
           "CSX_RUN_MIGRATIONS_ON_START": "false", "CSX_RUNS_DIR": str(folder / "runs"),
           "CSX_MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}"}
    token = subprocess.run(
        [sys.executable, "-m", "service.cli", "token", "create", "--name", "load", "--admin"],
        env=env, cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.strip().splitlines()[-1]
    servers, urls = [], []
    try:
        for index in range(count):
            port = free_port()
            servers.append(StackProcess.start(
                f"uvicorn-{index}", [sys.executable, "-m", "uvicorn", "service.main:app",
                                     "--host", HOST, "--port", str(port), "--log-level",
                                     "warning", "--no-access-log"],
                log_path=folder / f"uvicorn-{index}.log", env=env, cwd=ROOT))
            urls.append(f"http://{HOST}:{port}")
            wait_until_up(f"{urls[-1]}/v1/healthz", servers[-1], timeout_s=90)
        yield servers, urls, token
    finally:
        for server in servers:
            if server.popen.poll() is None:
                server.stop()


async def load(urls: list[str], token: str, total: int, clients: int,
               kill: Callable[[], None]) -> dict:
    auth = {"Authorization": f"Bearer {token}"}
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    accepted: set[int] = set()
    answered = 0
    killed = False
    pending = iter(range(total))
    limits = httpx.Limits(max_connections=clients + 4)

    async with httpx.AsyncClient(headers=auth, timeout=60, limits=limits) as http:
        async def submit(index: int) -> None:
            nonlocal answered, killed
            started, status = time.perf_counter(), None
            for attempt in range(TRIES):
                url = urls[(index + attempt) % len(urls)]
                try:
                    response = await http.post(
                        f"{url}/v1/jobs", json={**BODY, "name": f"load-{index}"},
                        headers={"Idempotency-Key": f"load-{index}"})
                except httpx.HTTPError as err:
                    statuses[type(err).__name__] += 1
                    continue
                status = response.status_code
                statuses[str(status)] += 1
                if status < 500:
                    break
            latencies.append(time.perf_counter() - started)
            if status == 201:
                accepted.add(index)
            answered += 1
            if not killed and answered >= KILL_AT * total:
                killed = True
                kill()

        async def client() -> None:
            for index in pending:
                await submit(index)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - started
    return {"elapsed_s": round(elapsed, 2), "req_per_s": round(total / elapsed, 1),
            "p50_ms": percentile(latencies, 0.5), "p99_ms": percentile(latencies, 0.99),
            "answers": dict(statuses), "accepted": sorted(accepted)}


async def hostile_and_health(urls: list[str], token: str, stop: asyncio.Event) -> dict:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/yaml"}
    answers: Counter[str] = Counter()
    health: list[float] = []

    async def upload(name: str) -> None:
        async with httpx.AsyncClient(headers=headers, timeout=120) as http:
            while not stop.is_set():
                for url in urls:
                    try:
                        response = await http.post(f"{url}/v1/jobs", content=HOSTILE[name])
                        answers[f"{name}: {response.status_code}"] += 1
                    except httpx.HTTPError as err:
                        answers[f"{name}: {type(err).__name__}"] += 1

    async def poll() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            while not stop.is_set():
                for url in urls:
                    started = time.perf_counter()
                    try:
                        if (await http.get(f"{url}/v1/healthz")).status_code == 200:
                            health.append(time.perf_counter() - started)
                    except httpx.HTTPError:
                        pass  # a killed process: its health is not the service's
                await asyncio.sleep(0.1)

    await asyncio.gather(*(upload(name) for name in HOSTILE), poll())
    return {"hostile_answers": dict(answers), "health_checks": len(health),
            "health_p50_ms": percentile(health, 0.5), "health_p99_ms": percentile(health, 0.99),
            "health_max_ms": round(1000 * max(health), 1) if health else None}


def stored(url: str) -> tuple[int, set[int]]:
    engine = create_engine(url)
    with engine.connect() as connection:
        rows = connection.execute(select(Job.name)).scalars().all()
        count = connection.execute(select(func.count()).select_from(Job)).scalar_one()
    engine.dispose()
    return count, {int(name.removeprefix("load-")) for name in rows}


def run_backend(backend: str, total: int, clients: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"csx-reliability-{backend}-") as tmp:
        folder = Path(tmp)
        with database(backend, folder) as url, \
                api_processes(url, folder, API_PROCESSES) as (servers, urls, token):
            def kill() -> None:
                os.kill(servers[0].popen.pid, signal.SIGKILL)

            async def both() -> tuple[dict, dict]:
                stop = asyncio.Event()
                side = asyncio.create_task(hostile_and_health(urls, token, stop))
                result = await load(urls, token, total, clients, kill)
                stop.set()
                return result, await side

            submissions, hostile = asyncio.run(both())
            count, names = stored(url)
    accepted = set(submissions.pop("accepted"))
    fives = sum(n for code, n in submissions["answers"].items() if code.startswith("5"))
    result = {"backend": backend, "api_processes": API_PROCESSES, "submissions": total,
              "clients": clients, "accepted": len(accepted), "lost": len(accepted - names),
              "duplicated": count - len(names), "stored": count, "answers_5xx": fives,
              **submissions, **hostile}
    print(f"{backend:>8}: {total} submissions, {clients} clients, {API_PROCESSES} API processes "
          f"(one SIGKILLed at {KILL_AT:.0%}): accepted {result['accepted']}, lost "
          f"{result['lost']}, duplicated {result['duplicated']}, 5xx {fives}; "
          f"{result['req_per_s']} req/s, p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms; "
          f"healthz during hostile uploads p99 {result['health_p99_ms']} ms, max "
          f"{result['health_max_ms']} ms ({result['health_checks']} checks)", flush=True)
    return result


def recover(backend: str) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"csx-recovery-{backend}-") as tmp:
        with database(backend, Path(tmp)) as url:
            return run_recovery(backend, url, Path(tmp))


def fault_table() -> tuple[list[dict], bool]:
    """bench/service_faults.py's and bench/file_faults.py's faults as one table, printed; and
    whether every fault was handled."""
    import abuse_faults  # bench/, this script's folder
    import file_faults
    import service_faults

    service_rows = service_faults.run_faults() + abuse_faults.run_faults()
    file_rows, files_sound = file_faults.run_faults()
    rows = service_rows + [file_faults.table_row(row) for row in file_rows]
    service_faults.print_table(rows)
    return rows, files_sound and all(service_faults.is_sound(row) for row in service_rows)


def _out_of_budget(signum: int, frame: object) -> None:
    raise TimeoutError("bench/reliability.py ran out of its --budget-s; stopping what it started")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 submissions, 20 clients")
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgres"],
                        choices=["sqlite", "postgres"])
    parser.add_argument("--no-recovery", action="store_true",
                        help="skip the worker/API kill of a real training job")
    parser.add_argument("--no-routes", action="store_true",
                        help="skip the 50 clients over every route (bench/route_load.py)")
    parser.add_argument("--no-faults", action="store_true",
                        help="skip the fault table (bench/service_faults.py, bench/file_faults.py)")
    parser.add_argument("--budget-s", type=int, default=3600,
                        help="stop everything after this many seconds")
    args = parser.parse_args()
    load_at_start = os.getloadavg()  # a shared machine: the run's neighbours, recorded
    signal.signal(signal.SIGALRM, _out_of_budget)
    signal.alarm(args.budget_s)
    total, clients = (200, 20) if args.quick else (1000, 50)
    runs = [run_backend(backend, total, clients) for backend in args.backends]
    recoveries = [] if args.no_recovery else [recover(backend) for backend in args.backends]
    routes = [] if args.no_routes else [
        route_load.run_backend(backend, clients=50, seconds=60.0, rates=[0.0], job_s=10.0)
        for backend in args.backends]
    faults, faults_sound = ([], True) if args.no_faults else fault_table()
    signal.alarm(0)
    sound = all(r["lost"] == 0 and r["duplicated"] == 0 and r["answers_5xx"] == 0
                and r["accepted"] == total for r in runs)
    recovered = all(r["resumed"] and r["bit_identical"] for r in recoveries)
    write_json(RESULTS, {
        "sound": sound, "recovered_bit_identical": recovered if recoveries else None,
        "client": "httpx.AsyncClient in the same machine's cores", "runs": runs,
        "recovery": recoveries, "routes": routes,
        "faults_handled": faults_sound if faults else None,
        "faults": faults}, load_at_start=load_at_start)
    print(f"0 lost, 0 duplicated, 0 x 5xx, all accepted: {'yes' if sound else 'NO'}")
    if recoveries:
        print(f"worker and API kills resumed, final checkpoints bit-identical: "
              f"{'yes' if recovered else 'NO'}")
    if routes:
        print("50 clients over every route, p99 <= 200 ms, 0 timeouts, 0 x 5xx but 503, "
              f"nothing left: {'yes' if all(r['meets_target'] for r in routes) else 'NO'}")
    if faults:
        print(f"every fault handled (0 lost, 0 stuck, 0 double-run, 0 x 5xx other than 503): "
              f"{'yes' if faults_sound else 'NO'}")
    return 0 if sound and recovered and faults_sound else 1


if __name__ == "__main__":
    sys.exit(main())
