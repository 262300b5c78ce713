"""Load test of the job API: N submissions from C concurrent clients to a paused queue.

Starts `uvicorn service.main:app` as a subprocess on 127.0.0.1 with a throwaway SQLite
database and CSX_PAUSED=true (jobs are stored and queued, none starts), creates a token with
`csx token create`, fires the submissions, then checks that exactly N jobs were stored.
Prints req/s, p50/p99 latency and errors; writes bench/results/api_load.json.

    python bench/api_load.py            # 1000 submissions, 50 clients
    python bench/api_load.py --quick    # 200 submissions, 20 clients
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
from pathlib import Path

import httpx
from sqlalchemy import create_engine, func, select

from service.local_stack import StackProcess, free_port, wait_until_up

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "api_load.json"
BODY = {
    "name": "load",
    "params": {
        "train_input": {"batch_size": 8, "seq_len": 16},
        "sparsity": {"algorithm": "rigl", "sparsity": 0.9, "update": {"freq": 10, "stop": 80}},
        "runconfig": {"max_steps": 100},
    },
}


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def fire(url: str, token: str, total: int, clients: int, deadline_s: float) -> dict:
    latencies: list[float] = []
    errors: dict[str, int] = {}
    next_index = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal next_index
        while next_index < total and time.monotonic() < deadline:
            index, next_index = next_index, next_index + 1
            started = time.perf_counter()
            try:
                response = await client.post("/v1/jobs", json={**BODY, "tags": {"i": str(index)}})
                if response.status_code != 201:
                    errors[str(response.status_code)] = errors.get(str(response.status_code), 0) + 1
            except httpx.HTTPError as err:
                errors[type(err).__name__] = errors.get(type(err).__name__, 0) + 1
            latencies.append(time.perf_counter() - started)

    deadline = time.monotonic() + deadline_s
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30,
                                 headers={"Authorization": f"Bearer {token}"}) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "requests": len(latencies), "elapsed_s": round(elapsed, 3),
        "req_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(1000 * percentile(latencies, 0.50), 1),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 1),
        "max_ms": round(1000 * latencies[-1], 1),
        "errors": errors, "timed_out": len(latencies) < total,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 submissions, 20 clients")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--clients", type=int)
    parser.add_argument("--deadline_s", type=float, default=150.0)
    args = parser.parse_args()
    total = args.requests or (200 if args.quick else 1000)
    clients = args.clients or (20 if args.quick else 50)

    with tempfile.TemporaryDirectory(prefix="csx-load-") as folder:
        db_url = f"sqlite:///{folder}/csx.db"
        env = {**os.environ, "CSX_DATABASE_URL": db_url, "CSX_PAUSED": "true",
               "CSX_RUNS_DIR": f"{folder}/runs",
               "CSX_MLFLOW_TRACKING_URI": f"sqlite:///{folder}/mlflow.db"}
        token = subprocess.run(
            [sys.executable, "-m", "service.cli", "token", "create", "--name", "load", "--admin"],
            env=env, cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()[-1]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = StackProcess.start(
            "uvicorn", [sys.executable, "-m", "uvicorn", "service.main:app", "--host",
                        "127.0.0.1", "--port", str(port), "--log-level", "warning",
                        "--no-access-log"],
            log_path=Path(folder) / "uvicorn.log", env=env, cwd=ROOT)
        try:
            wait_until_up(f"{url}/v1/healthz", server, timeout_s=60)
            result = asyncio.run(fire(url, token, total, clients, args.deadline_s))
        finally:
            server.popen.terminate()
            server.popen.wait(timeout=30)
        engine = create_engine(db_url)
        from service.models import Job

        with engine.connect() as connection:
            stored = connection.execute(select(func.count()).select_from(Job)).scalar_one()
        engine.dispose()

    result.update({"submissions": total, "clients": clients, "stored_jobs": stored,
                   "server": "uvicorn, 1 process, SQLite WAL, paused queue",
                   "exact": stored == total and not result["errors"]})
    print(f"{total} submissions from {clients} clients in {result['elapsed_s']} s: "
          f"{result['req_per_s']} req/s, p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, "
          f"errors {result['errors'] or 0}, stored {stored}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
