"""Load test of the job API: N submissions from C concurrent clients to a paused queue.

Starts `uvicorn service.main:app` as a subprocess on 127.0.0.1 with a throwaway SQLite
database and CSX_PAUSED=true (jobs are stored and queued, none starts), creates a token with
`csx token create`, fires the submissions, then checks that exactly N jobs were stored.
Two phases, each against a fresh server and database:

* saturation: every client sends its next request as soon as the last one is answered, so
  the server is never idle; this measures the most req/s it sustains.
* paced: the same N submissions arrive at a fixed rate (default 300 req/s, the target) spread
  over the C clients; this measures the latency a client sees at that load.

Both are needed: with C clients always waiting on the server, Little's law makes the mean
latency C / throughput (50 clients at 500 req/s wait 100 ms each whatever the server does), so
a saturated run says nothing about latency at a given load. Targets: >= 300 req/s saturated,
p99 <= 50 ms at 300 req/s. The client is bench/http_client.py's bare asyncio one (about 0.1 ms
of CPU per request) because it shares the machine's cores with the server. Prints req/s and
p50/p99 latency per phase; writes bench/results/api_load.json.

    python bench/api_load.py            # 1000 submissions, 50 clients, per phase
    python bench/api_load.py --quick    # 200 submissions, 20 clients, per phase
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import create_engine, func, select

from http_client import CONNECTION_ERRORS, Connection  # bench/ is on sys.path as a script
from record import write_json
from service.processes import HOST, StackProcess, free_port, wait_until_up

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "api_load.json"
TARGET_REQ_PER_S, TARGET_P99_MS = 300.0, 50.0
BODY = {
    "name": "load",
    "params": {
        "train_input": {"batch_size": 8, "max_sequence_length": 16},
        "sparsity": {"algorithm": "rigl", "sparsity": 0.9, "update": {"freq": 10, "stop": 80}},
        "runconfig": {"max_steps": 100},
    },
}


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def fire(port: int, token: str, total: int, clients: int, rate: float | None,
               deadline_s: float) -> dict:
    """`total` submissions over `clients` connections; paced at `rate` req/s when given."""
    tally = Tally()
    bodies = [json.dumps({**BODY, "tags": {"i": str(i)}}).encode() for i in range(total)]
    pending = iter(range(total))
    connections = [await Connection.open(HOST, port, {"Authorization": f"Bearer {token}"})
                   for _ in range(clients)]
    started = time.perf_counter()
    deadline = started + deadline_s

    async def client_loop(connection: Connection) -> None:
        for index in pending:
            due = started + index / rate if rate else time.perf_counter()
            if due > deadline:
                return
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            try:
                status = (await connection.request("POST", "/v1/jobs", bodies[index])).status_code
            except CONNECTION_ERRORS as err:
                tally.error(type(err).__name__)
                return  # the connection is in an unknown state: this client stops
            # Latency from when the request was due, so a late send counts against the server.
            tally.latencies.append(time.perf_counter() - due)
            if status != 201:
                tally.error(str(status))

    await asyncio.gather(*(client_loop(c) for c in connections))
    elapsed = time.perf_counter() - started
    for connection in connections:
        connection.close()
    latencies = sorted(tally.latencies)
    return {
        "requests": len(latencies), "elapsed_s": round(elapsed, 3),
        "req_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(1000 * percentile(latencies, 0.50), 2),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 2),
        "max_ms": round(1000 * latencies[-1], 2) if latencies else None,
        "errors": tally.errors, "timed_out": len(latencies) < total,
    }


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


@contextmanager
def api_server(folder: Path) -> Iterator[tuple[int, str, str]]:
    """A uvicorn on a fresh SQLite database with a paused queue: (port, token, db url)."""
    db_url = f"sqlite:///{folder}/csx.db"
    env = {**os.environ, "CSX_DATABASE_URL": db_url, "CSX_PAUSED": "true",
           "CSX_RUNS_DIR": f"{folder}/runs", "CSX_MLFLOW_TRACKING_URI": f"sqlite:///{folder}/mlflow.db"}
    token = subprocess.run(
        [sys.executable, "-m", "service.cli", "token", "create", "--name", "load", "--admin"],
        env=env, cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.strip().splitlines()[-1]
    port = free_port()
    server = StackProcess.start(
        "uvicorn", [sys.executable, "-m", "uvicorn", "service.main:app", "--host", HOST,
                    "--port", str(port), "--log-level", "warning", "--no-access-log"],
        log_path=folder / "uvicorn.log", env=env, cwd=ROOT)
    try:
        wait_until_up(f"http://{HOST}:{port}/v1/healthz", server, timeout_s=60)
        yield port, token, db_url
    finally:
        server.stop()


def stored_jobs(db_url: str) -> int:
    from service.models import Job

    engine = create_engine(db_url)
    with engine.connect() as connection:
        count = connection.execute(select(func.count()).select_from(Job)).scalar_one()
    engine.dispose()
    return count


def run_phase(name: str, total: int, clients: int, rate: float | None,
              deadline_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="csx-load-") as folder:
        with api_server(Path(folder)) as (port, token, db_url):
            result = asyncio.run(fire(port, token, total, clients, rate, deadline_s))
        result["stored_jobs"] = stored_jobs(db_url)
    result.update({"phase": name, "submissions": total, "clients": clients,
                   "offered_req_per_s": rate,
                   "exact": result["stored_jobs"] == total and not result["errors"]})
    offered = f" at an offered {rate:g} req/s" if rate else ""
    print(f"{name:>10}: {total} submissions from {clients} clients{offered} in "
          f"{result['elapsed_s']} s: {result['req_per_s']} req/s, p50 {result['p50_ms']} ms, "
          f"p99 {result['p99_ms']} ms, errors {result['errors'] or 0}, stored "
          f"{result['stored_jobs']}", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 submissions, 20 clients")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--clients", type=int)
    parser.add_argument("--rate", type=float, default=TARGET_REQ_PER_S,
                        help="offered load of the paced phase, req/s")
    parser.add_argument("--deadline_s", type=float, default=120.0, help="per phase")
    args = parser.parse_args()
    load_at_start = os.getloadavg()  # a shared machine: the run's neighbours, recorded
    total = args.requests or (200 if args.quick else 1000)
    clients = args.clients or (20 if args.quick else 50)

    saturated = run_phase("saturation", total, clients, None, args.deadline_s)
    paced = run_phase("paced", total, clients, args.rate, args.deadline_s)
    meets = (saturated["req_per_s"] >= TARGET_REQ_PER_S and paced["p99_ms"] <= TARGET_P99_MS
             and paced["req_per_s"] >= 0.95 * args.rate)
    result = {
        "req_per_s": saturated["req_per_s"], "saturated_p99_ms": saturated["p99_ms"],
        "paced_p50_ms": paced["p50_ms"], "paced_p99_ms": paced["p99_ms"],
        "offered_req_per_s": args.rate, "meets_target": meets,
        "exact": saturated["exact"] and paced["exact"],
        "server": "uvicorn, 1 process, SQLite WAL, paused queue",
        "phases": [saturated, paced],
    }
    print(f"targets (>= {TARGET_REQ_PER_S:g} req/s, p99 <= {TARGET_P99_MS:g} ms at "
          f"{args.rate:g} req/s): {'met' if meets else 'MISSED'}")
    write_json(RESULTS, result, load_at_start=load_at_start)
    return 0 if result["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
