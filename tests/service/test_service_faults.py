"""Faults the service must survive (issue 32): many concurrent requests, a database that fails
under a running job, a second server on the same database, MLflow away during a cancel.

Each test drives the in-process app (TestClient) with the scripted launcher, so faults are
injected exactly where they matter and nothing waits on Ray or training.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.exc import OperationalError

from service.main import create_app
from service.settings import Settings
from service_helpers import ScriptedLauncher, job_body, make_token, wait_for, wait_status


def _submit(client: TestClient, headers: dict[str, str], **options: Any) -> int:
    response = client.post("/v1/jobs", json=job_body(**options), headers=headers)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def test_fifty_concurrent_clients_on_every_route_all_answer(client: TestClient,
                                                            alice: dict[str, str]) -> None:
    """Today's code deadlocked at ~16: the auth dependency waited on the event loop for a pooled
    connection that only the blocked loop could give back. Now every request answers, with a
    2xx (or a fast 503 when the pool is saturated), and healthz keeps answering meanwhile."""
    job_id = _submit(client, alice)
    routes = [
        ("GET", f"/v1/jobs/{job_id}", None), ("GET", "/v1/jobs?limit=5", None),
        ("GET", f"/v1/jobs/{job_id}/events", None), ("GET", f"/v1/jobs/{job_id}/logs", None),
        ("GET", "/v1/cluster", None), ("GET", "/v1/healthz", None),
        ("POST", "/v1/jobs", job_body(runconfig={"max_steps": 10})),
    ]

    def one(i: int) -> int:
        method, path, body = routes[i % len(routes)]
        return client.request(method, path, json=body, headers=alice).status_code

    started = time.monotonic()
    with ThreadPoolExecutor(50) as pool:
        codes = Counter(pool.map(one, range(400)))
    elapsed = time.monotonic() - started
    assert set(codes) <= {200, 201, 503}, codes
    assert codes[200] + codes[201] >= 350, codes
    # A deadlock shows as requests stuck until the pool's 30 s timeout; this bound is generous
    # for a busy 2-core machine and far below what the deadlock took (minutes for 400).
    assert elapsed < 120, f"400 requests took {elapsed:.0f} s: {codes}"
    assert client.get("/v1/healthz").status_code == 200
