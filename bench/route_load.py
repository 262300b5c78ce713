"""50 clients over every route of the job API, then every job cancelled by 20 clients.

A real `uvicorn` process serves `service.main:create_app` with its scheduler running; only the
training is scripted (`TimedLauncher`: a job "trains" for --job-s seconds and ends with an
evaluation history, or stops at once when cancelled), so the numbers are the service's, not
the CPU a training job takes from it on this machine. Per backend (SQLite WAL file, or a
private PostgreSQL server from tests/service/pg.sh):

1. seed: a finished 4-variant study (its report has curves) and a job with a large log;
2. load: --clients clients, each sending its next request when the last is answered (or, with
   --rate R, at its own share of R requests/s in all: an open load the server must keep up
   with), for --seconds, round-robin over every route: submit, validate, list, get, events, logs (of the
   large log), cancel and retry (of the jobs submitted so far), study submit, get, report and
   report.png, cluster, healthz, MLflow credentials;
3. cancel-all: every job not yet terminal cancelled by 20 clients; then nothing may stay in a
   non-terminal state.

The load's clients are bench/http_client.py's bare asyncio ones; first, as a ceiling, the same
number of them and of httpx clients load a server that answers at once (what the clients
alone can drive on this machine's cores); then, as a floor, the bare clients load GET
/v1/jobs/{id}'s shape (token check, owner lookup, handler, response model) served from memory by
FastAPI alone (what the framework costs before any database or service code).

Prints per route p50/p99 and the totals (p99 over every request, timeouts, 5xx other than 503,
jobs left non-terminal); writes bench/results/route_load.json.

    python bench/route_load.py                       # SQLite and PostgreSQL, 50 clients, 60 s
    python bench/route_load.py --backends sqlite --seconds 20
    python bench/route_load.py --rate 0 100 150    # as fast as answered, then paced
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel

import http_client  # bench/, this script's folder
from record import write_json
from service.cli import default_api_workers

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "route_load.json"
TARGET_P99_MS = 200.0
CLIENT_TIMEOUT_S = 30.0
LOG_MB = 64
SMALL = {"train_input": {"batch_size": 8, "max_sequence_length": 16},
         "model": {"preset": "tiny"}, "runconfig": {"max_steps": 10}}
JOB = {"params": {**SMALL, "sparsity": {"algorithm": "rigl", "sparsity": 0.8,
                                        "update": {"freq": 5}}}}
STUDY = {"name": "load", "params": {**SMALL, "eval_input": {"batch_size": 8}},
         "algorithms": ["dense", "static", "set", "rigl"], "sparsity": 0.8}
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


class TimedHandle:
    """A job that trains for `seconds`, then reports an evaluation history."""

    def __init__(self, seconds: float, seed: int) -> None:
        self.run_id = None
        self.seconds, self.seed = seconds, seed
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    def wait(self) -> dict[str, Any]:
        if self._cancelled.wait(self.seconds):
            raise RuntimeError("job cancelled")
        history = [{"step": step, "loss": 5.0 - step / 10 - self.seed / 100,
                    "perplexity": 150.0 - step - self.seed} for step in range(1, 11)]
        return {"eval_history": history, "final_eval_perplexity": history[-1]["perplexity"],
                "best_eval_perplexity": history[-1]["perplexity"], "speedup_vs_dense": 1.5}


class TimedLauncher:
    def __init__(self, seconds: float) -> None:
        self.seconds, self.launched = seconds, 0

    def __call__(self, spec: Any, **kwargs: Any) -> TimedHandle:
        self.launched += 1
        return TimedHandle(self.seconds, self.launched % 7)


def scripted_app() -> Any:
    """The app from CSX_* settings, jobs scripted (ROUTE_LOAD_JOB_S seconds each)."""
    from service.main import create_app
    from service.settings import Settings

    return create_app(Settings(), launcher=TimedLauncher(float(os.environ["ROUTE_LOAD_JOB_S"])),
                      tune_collector=True)


class FloorJob(BaseModel):
    id: int
    name: str
    status: str
    params: dict[str, Any]


def floor_caller(request: Request) -> str:
    return request.headers.get("authorization", "")


def floor_owned(job_id: int, user: str = Depends(floor_caller)) -> FloorJob:
    return FloorJob(id=job_id, name="floor", status="RUNNING", params=JOB["params"])


def floor_get_job(job: FloorJob = Depends(floor_owned),
                  user: str = Depends(floor_caller)) -> FloorJob:
    return job


def floor_app() -> FastAPI:
    """GET /v1/jobs/{id}'s shape without the service: a plain-function token check and owner
    lookup as dependencies, a plain-function handler and a response model (four thread-pool
    hops), answering from memory. What FastAPI itself costs per request on this machine."""
    app = FastAPI()
    app.get("/v1/jobs/{job_id}", response_model=FloorJob)(floor_get_job)
    return app


def serve(port: int, job_s: float, workers: int, app: str = "scripted_app") -> None:
    """The server: `workers` processes (uvicorn's) of the scripted app (or the floor's)."""
    import uvicorn

    from service.main import KEEP_ALIVE_S

    os.environ["ROUTE_LOAD_JOB_S"] = str(job_s)
    os.environ["CSX_API_WORKERS"] = str(workers)  # as csx serve tells its workers
    sys.path.insert(0, str(Path(__file__).parent))  # the workers import this module
    uvicorn.run(f"route_load:{app}", factory=True, workers=workers, host="127.0.0.1",
                port=port, log_level="warning", access_log=False, timeout_keep_alive=KEEP_ALIVE_S)


@contextmanager
def database(backend: str, folder: Path) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{folder / 'csx.db'}"
        return
    sys.path.insert(0, str(ROOT / "tests" / "service"))  # the tests' private server helper
    from service_helpers import PostgresServer

    server = PostgresServer.start()
    try:
        yield server.create_database("load").replace("postgresql://", "postgresql+psycopg://")
    finally:
        server.stop()


@contextmanager
def api_server(url: str, folder: Path, job_s: float,
               workers: int = 1) -> Iterator[tuple[str, dict[str, str], int]]:
    from service.processes import HOST, StackProcess, free_port, wait_until_up

    env = {**os.environ, "CSX_DATABASE_URL": url, "CSX_RUNS_DIR": str(folder / "runs"),
           "CSX_MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}",
           "CSX_CLUSTER_SIZE": "4"}
    tokens = {}
    for name, admin in (("root", ["--admin"]), ("alice", [])):
        tokens[name] = subprocess.run(
            [sys.executable, "-m", "service.cli", "token", "create", "--name", name, *admin],
            env=env, cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()[-1]
    port = free_port()
    server = StackProcess.start("uvicorn", [sys.executable, __file__, "serve", "--port", str(port),
                                            "--job-s", str(job_s),
                                            "--workers", str(workers)],
                                log_path=folder / "server.log", env=env, cwd=ROOT)
    try:
        wait_until_up(f"http://{HOST}:{port}/v1/healthz", server, timeout_s=120)
        yield f"http://{HOST}:{port}", tokens, server.popen.pid
    finally:
        server.stop()


async def until(http: httpx.AsyncClient, path: str, done: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = (await http.get(path)).json()
        if done(body):
            return body
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{path} did not get there in {timeout_s} s")


def large_log(folder: Path, url: str, job_id: int, megabytes: int) -> None:
    """Fill the job's log with `megabytes` of progress lines (what a long run writes)."""
    from sqlalchemy import create_engine, select

    from service import joblogs
    from service.models import Job

    engine = create_engine(url)
    with engine.connect() as connection:
        run_key = connection.execute(select(Job.run_key).where(Job.id == job_id)).scalar_one()
    engine.dispose()
    log = joblogs.log_path(joblogs.job_dir(folder / "runs", job_id, run_key))
    line = b'2026-01-01T00:00:00.000+00:00 {"step": 12345, "loss": 3.14159, "tokens_per_s": 1e5}\n'
    block = line * ((1 << 20) // len(line))
    with log.open("ab") as out:
        for _ in range(megabytes):
            out.write(block)


def cpu_seconds(pid: int) -> float:
    """CPU time the process and its live descendants (uvicorn's workers) have used (user +
    system): what a request costs the server, whatever else the machine runs meanwhile."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
                    for child in (task / "children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
        return 0.0
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(cpu_seconds(child) for child in children)


async def load(base: str, tokens: dict[str, str], folder: Path, url: str, clients: int,
               seconds: float, rates: list[float | None], server_cpu: Any) -> dict[str, Any]:
    alice = {"Authorization": f"Bearer {tokens['alice']}"}
    root = {"Authorization": f"Bearer {tokens['root']}"}
    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=clients + 10)
    async with httpx.AsyncClient(base_url=base, headers=alice, timeout=CLIENT_TIMEOUT_S,
                                 limits=limits) as http:
        study = (await http.post("/v1/studies", json=STUDY)).json()
        await until(http, f"/v1/studies/{study['id']}", lambda s: s["status"] == "DONE", 120)
        logged = (await http.post("/v1/jobs", json=JOB)).json()["id"]
        await until(http, f"/v1/jobs/{logged}", lambda j: j["status"] in TERMINAL, 60)
        large_log(folder, url, logged, LOG_MB)
        submitted: list[int] = [logged]
        cancelled: list[int] = []
        loader = http_client.Client(base, alice, CLIENT_TIMEOUT_S)  # bench/http_client.py: why
        routes = _routes(loader, study["id"], logged, submitted, cancelled)
        phases = [await _phase(routes, clients, seconds, rate, server_cpu) for rate in rates]
        loader.close()
        left = await cancel_all(http, root)
    return {"phases": phases, **left}


def _routes(http: http_client.Client, sid: int, logged: int, submitted: list[int],
            cancelled: list[int]) -> dict[str, Any]:
    """Every route, each a function sending one request."""

    async def submit(path: str, body: dict) -> http_client.Answer:
        answer = await http.post(path, json=body)
        if answer.status_code == 201 and path == "/v1/jobs":
            submitted.append(answer.json()["id"])
        return answer

    async def cancel() -> http_client.Answer:
        answer = await http.post(f"/v1/jobs/{submitted[-1]}:cancel")
        if answer.status_code == 202:
            cancelled.append(submitted[-1])
        return answer

    return {
        "POST /jobs": lambda: submit("/v1/jobs", JOB),
        "POST /jobs:validate": lambda: http.post("/v1/jobs:validate", json=JOB),
        "GET /jobs": lambda: http.get("/v1/jobs?limit=20"),
        "GET /jobs/{id}": lambda: http.get(f"/v1/jobs/{submitted[-1]}"),
        "GET /jobs/{id}/events": lambda: http.get(f"/v1/jobs/{submitted[-1]}/events"),
        "GET /jobs/{id}/logs": lambda: http.get(f"/v1/jobs/{logged}/logs"),
        "POST /jobs/{id}:cancel": cancel,
        "POST /jobs/{id}:retry": lambda: http.post(
            f"/v1/jobs/{(cancelled or submitted)[-1]}:retry"),
        "POST /studies": lambda: submit("/v1/studies", {**STUDY, "algorithms": ["static"]}),
        "GET /studies/{id}": lambda: http.get(f"/v1/studies/{sid}"),
        "GET /studies/{id}/report": lambda: http.get(f"/v1/studies/{sid}/report"),
        "GET /studies/{id}/report.png": lambda: http.get(f"/v1/studies/{sid}/report.png"),
        "GET /cluster": lambda: http.get("/v1/cluster"),
        "GET /healthz": lambda: http.get("/v1/healthz"),
        "GET /mlflow/credentials": lambda: http.get("/v1/mlflow/credentials"),
    }


async def _phase(routes: dict[str, Any], clients: int, seconds: float, rate: float | None,
                 server_cpu: Any) -> dict[str, Any]:
    """`clients` clients round-robin over `routes` for `seconds`: each sends its next request
    when the last is answered, or, at a `rate` (req/s in all), at its own slots (clients
    start staggered; a late answer makes the next request go at once, never skips it)."""
    names = list(routes)
    latencies: dict[str, list[float]] = defaultdict(list)
    codes: dict[str, Counter[int]] = defaultdict(Counter)
    resets: Counter[str] = Counter()
    counter = iter(range(10**9))
    deadline = time.monotonic() + seconds

    async def client(index: int) -> None:
        interval = clients / rate if rate else 0.0
        slot = time.monotonic() + index * interval / clients
        while time.monotonic() < deadline:
            if rate:
                await asyncio.sleep(max(0.0, slot - time.monotonic()))
                slot += interval
            name = names[next(counter) % len(names)]
            started = time.perf_counter()
            try:
                code = (await routes[name]()).status_code
            except TimeoutError:
                code = -1
            except http_client.CONNECTION_ERRORS as err:
                code = 0
                resets[type(err).__name__] += 1
            latencies[name].append(time.perf_counter() - started)
            codes[name][code] += 1

    started, cpu, own_cpu = time.perf_counter(), server_cpu(), time.process_time()
    await asyncio.gather(*(client(index) for index in range(clients)))
    wall, cpu = time.perf_counter() - started, server_cpu() - cpu
    own_cpu = time.process_time() - own_cpu
    every = sorted(t for values in latencies.values() for t in values)
    per_route = {name: {"n": len(latencies[name]), "p50_ms": ms(latencies[name], 0.5),
                        "p99_ms": ms(latencies[name], 0.99), "codes": dict(codes[name])}
                 for name in names}
    all_codes = sum(codes.values(), Counter())
    return {"offered_req_per_s": rate, "requests": len(every),
            "req_per_s": round(len(every) / wall, 1),
            "p50_ms": ms(every, 0.5), "p99_ms": ms(every, 0.99),
            "server_cpu_ms_per_request": round(1000 * cpu / max(1, len(every)), 2),
            "server_cpu_share": round(cpu / wall, 2),
            # The clients share the machine's cores: what they take, the server cannot have.
            "client_cpu_share": round(own_cpu / wall, 2),
            "timeouts": all_codes[-1], "resets": all_codes[0], "reset_kinds": dict(resets),
            "bad_5xx": sum(n for code, n in all_codes.items() if code >= 500 and code != 503),
            "answers_503": all_codes[503], "routes": per_route}


async def cancel_all(http: httpx.AsyncClient, root: dict[str, str]) -> dict[str, Any]:
    """Every job not terminal cancelled by 20 clients; then wait until none is left."""
    ids: list[int] = []
    cursor = None
    while True:
        page = (await http.get("/v1/jobs", params={"limit": 100, **(
            {"cursor": cursor} if cursor else {})}, headers=root)).json()
        ids += [job["id"] for job in page["data"] if job["status"] not in TERMINAL]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    pending = list(ids)
    answers: Counter[int | str] = Counter()

    async def canceller() -> None:
        while pending:
            try:
                answer = await http.post(f"/v1/jobs/{pending.pop()}:cancel", headers=root)
                answers[answer.status_code] += 1
            except httpx.TransportError as err:  # counted; the job is then left to the check
                answers[type(err).__name__] += 1

    started = time.perf_counter()
    await asyncio.gather(*(canceller() for _ in range(20)))
    left: list[int] = list(ids)
    deadline = time.monotonic() + 60
    while left and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        statuses = [(await http.get(f"/v1/jobs/{i}", headers=root)).json()["status"]
                    for i in left]
        left = [i for i, s in zip(left, statuses) if s not in TERMINAL]
    return {"cancelled": len(ids), "cancel_answers": dict(answers), "left_non_terminal": len(left),
            "cancel_all_s": round(time.perf_counter() - started, 2)}


def harness_ceiling(clients: int, seconds: float) -> dict[str, Any]:
    """What the clients alone can drive: `clients` of each kind, each sending when answered,
    against a server that answers at once (bench/http_client.py)."""

    async def measure(http: Any) -> dict[str, Any]:
        phase = await _phase({"GET": lambda: http.get("/")}, clients, seconds, None, lambda: 0.0)
        return {key: phase[key] for key in ("requests", "req_per_s", "p50_ms", "p99_ms",
                                             "client_cpu_share")}

    async def both(base: str) -> dict[str, Any]:
        bare = http_client.Client(base, {}, CLIENT_TIMEOUT_S)
        ceiling = {"bare asyncio": await measure(bare)}
        bare.close()
        limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=clients + 10)
        async with httpx.AsyncClient(base_url=base, timeout=CLIENT_TIMEOUT_S,
                                     limits=limits) as http:
            ceiling["httpx.AsyncClient"] = await measure(http)
        return ceiling

    with http_client.null_server() as base:
        ceiling = asyncio.run(both(base))
    for kind, row in ceiling.items():
        print(f"harness ceiling, {clients} {kind} clients against a null server: "
              f"{row['req_per_s']} req/s, p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms "
              f"({row['client_cpu_share']} of a core)", flush=True)
    return ceiling


def framework_floor(clients: int, seconds: float) -> dict[str, Any]:
    """`clients` bare clients, each sending when answered, against `floor_app`: the latency
    the framework alone gives on these cores, before any database or service code."""
    from service.processes import HOST, StackProcess, free_port, wait_until_up

    async def measure(base: str, pid: int) -> dict[str, Any]:
        http = http_client.Client(base, {}, CLIENT_TIMEOUT_S)
        phase = await _phase({"GET": lambda: http.get("/v1/jobs/1")}, clients, seconds, None,
                             lambda: cpu_seconds(pid))
        http.close()
        return phase

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="csx-floor-") as tmp:
        server = StackProcess.start("uvicorn", [sys.executable, __file__, "serve", "--port",
                                                str(port), "--job-s", "0", "--app", "floor_app"],
                                    log_path=Path(tmp) / "server.log", env=dict(os.environ),
                                    cwd=ROOT)
        try:
            wait_until_up(f"http://{HOST}:{port}/v1/jobs/1", server, timeout_s=60)
            phase = asyncio.run(measure(f"http://{HOST}:{port}", server.popen.pid))
        finally:
            server.stop()
    floor = {key: phase[key] for key in ("requests", "req_per_s", "p50_ms", "p99_ms",
                                          "server_cpu_ms_per_request", "server_cpu_share")}
    print(f"framework floor, {clients} clients on GET /v1/jobs/{{id}}'s shape served from "
          f"memory: {floor['req_per_s']} req/s, p50 {floor['p50_ms']} ms, p99 "
          f"{floor['p99_ms']} ms, server CPU {floor['server_cpu_ms_per_request']} ms/request",
          flush=True)
    return floor


def ms(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) \
        if ordered else None


def run_backend(backend: str, clients: int, seconds: float, rates: list[float], job_s: float,
                keep_dir: Path | None = None, workers: int = 1) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"csx-routes-{backend}-") as tmp:
        folder = keep_dir / backend if keep_dir else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        with database(backend, folder) as url, \
                api_server(url, folder, job_s, workers) as (base, tokens, pid):
            result = asyncio.run(load(base, tokens, folder, url, clients, seconds,
                                      [rate or None for rate in rates],
                                      lambda: cpu_seconds(pid)))
    result = {"backend": backend, "clients": clients, "seconds": seconds, "workers": workers,
              **result}
    for phase in result["phases"]:
        phase["meets_target"] = (phase["p99_ms"] <= TARGET_P99_MS and phase["timeouts"] == 0
                                 and phase["resets"] == 0 and phase["bad_5xx"] == 0)
        offered = (f"at {phase['offered_req_per_s']:g} req/s offered"
                   if phase["offered_req_per_s"] else "each waiting for its answer")
        print(f"{backend}, {workers} worker(s): {phase['requests']} requests from {clients} "
              f"clients {offered}, "
              f"{seconds:g} s ({phase['req_per_s']} req/s): p50 {phase['p50_ms']} ms, "
              f"p99 {phase['p99_ms']} ms, server CPU {phase['server_cpu_ms_per_request']} "
              f"ms/request ({phase['server_cpu_share']} of a core; the clients "
              f"{phase['client_cpu_share']}), {phase['timeouts']} timeouts, {phase['resets']} "
              f"resets {phase['reset_kinds']}, {phase['bad_5xx']} x 5xx "
              f"(503: {phase['answers_503']})", flush=True)
        for name, row in phase["routes"].items():
            print(f"    {name:<28} n={row['n']:<5} p50 {row['p50_ms']} ms  "
                  f"p99 {row['p99_ms']} ms  {row['codes']}")
    print(f"{backend}: cancel-all of {result['cancelled']}: {result['left_non_terminal']} left "
          f"({result['cancel_all_s']} s)", flush=True)
    result["meets_target"] = (all(phase["meets_target"] for phase in result["phases"])
                              and result["left_non_terminal"] == 0)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    serve_args = sub.add_parser("serve")
    serve_args.add_argument("--port", type=int, required=True)
    serve_args.add_argument("--job-s", type=float, required=True)
    serve_args.add_argument("--workers", type=int, default=1)
    serve_args.add_argument("--app", default="scripted_app", choices=["scripted_app", "floor_app"])
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgres"],
                        choices=["sqlite", "postgres"])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60.0, help="per phase")
    parser.add_argument("--rate", type=float, nargs="+", default=[0.0],
                        help="one phase per value: requests/s offered by the clients in all "
                             "(0: each client sends when its last request is answered)")
    parser.add_argument("--job-s", type=float, default=10.0,
                        help="how long a job trains (a tiny-preset job on Ray: 10-30 s)")
    parser.add_argument("--workers", type=int, default=default_api_workers(),
                        help="uvicorn worker processes (one schedules, the others stand by; "
                             "default: csx serve's)")
    parser.add_argument("--keep-dir", type=Path,
                        help="keep each backend's folder (server.log, databases) here")
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    if args.command == "serve":
        serve(args.port, args.job_s, args.workers, args.app)
        return 0
    ceiling = harness_ceiling(args.clients, min(args.seconds, 10.0))
    floor = framework_floor(args.clients, min(args.seconds, 10.0))
    runs = [run_backend(b, args.clients, args.seconds, args.rate, args.job_s, args.keep_dir,
                        args.workers) for b in args.backends]
    write_json(RESULTS, {  # with the machine and its load (bench/record.py)
        "target": f"p99 <= {TARGET_P99_MS:g} ms, 0 timeouts, 0 resets, 0 x 5xx but 503, "
                  "nothing left non-terminal",
        "client": "bench/http_client.py's bare asyncio client, in the same machine's cores",
        "harness_ceiling": ceiling, "framework_floor": floor, "runs": runs},
               load_at_start=load_at_start)
    return 0 if all(r["meets_target"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
