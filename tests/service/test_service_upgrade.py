"""An upgrade from the first release (issue 47 item 4): a database made by revision 0001, its
jobs' specs in the first release's layout, migrated to head; the queue runs, the running job
resumes, a failed one can be retried, every stored spec validates and means what it meant."""

from __future__ import annotations

import importlib.util
import json
import math
from datetime import UTC, datetime
from pathlib import Path

from alembic import command
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import text

from csx_config import JobSpec
from csx_config.schedulers import learning_rate_at
from service import crud
from service.db import alembic_config, make_engine
from service.main import create_app
from service.settings import Settings
from service_helpers import ScriptedLauncher, job_body, wait_for, wait_status

MIGRATION = Path(__file__).resolve().parents[2] / "migrations" / "versions" / \
    "0006_stored_specs_current_layout.py"
# JobSpec(...).model_dump(mode="json") of the first release (workers/spec.py at cf3979c).
FIRST_RELEASE_PARAMS = {
    "train_input": {"data_dir": "builtin:shakespeare", "batch_size": 8, "seq_len": 16,
                    "shuffle": True},
    "eval_input": {"data_dir": None, "batch_size": 8, "seq_len": 16, "shuffle": True},
    "model": {"preset": "tiny", "n_layer": 3, "n_head": None, "d_model": None, "d_ff": None,
              "max_seq_len": None, "tie_embeddings": None, "sparse_wide_sparsity": 0.0,
              "tokenizer": {"type": "byte", "vocab_size": None}},
    "optimizer": {"type": "SGD", "learning_rate": {
        "type": "warmup_cosine", "peak": 0.01, "warmup_steps": 3, "minimum": 0.001,
        "decay_steps": None}, "weight_decay": 0.0, "max_gradient_norm": None, "betas": None,
        "eps": None, "momentum": 0.9},
    "sparsity": {"algorithm": "rigl", "sparsity": 0.8, "update": {"freq": 5}},
    "runconfig": {"max_steps": 10, "eval_steps": 10, "eval_frequency": 0, "checkpoint_steps": 0,
                  "log_steps": 10, "seed": 0, "num_csx": 1, "max_failures": 3,
                  "mlflow_experiment": "csx-sparse", "model_dir": None, "checkpoint_path": None,
                  "sparse_kernel": "auto"}}


def first_release_factor(warmup: int, minimum: float, peak: float, decay: int, step: int) -> float:
    """The first release's learning-rate factor (workers/job.py's lr_factor at cf3979c)."""
    if step < warmup:
        return (step + 1) / warmup
    if step >= decay:
        return minimum / peak
    floor = minimum / peak
    progress = (step - warmup) / max(1, decay - warmup)
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - floor)


def _migration():
    spec = importlib.util.spec_from_file_location("stored_specs_0006", MIGRATION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_release_database(url: str) -> str:
    """A database at revision 0001 with a running, a queued and a failed job; the token."""
    command.upgrade(alembic_config(url), "0001")
    secret, now = "csx_first-release-token", datetime.now(UTC)
    engine = make_engine(url)
    with engine.begin() as db:
        db.execute(text("INSERT INTO tokens (id, name, token_hash, is_admin, created_at) "
                        "VALUES (1, 'alice', :hash, 0, :now)"),
                   {"hash": crud.hash_secret(secret), "now": now})
        for job_id, status, systems in ((1, "RUNNING", [0]), (2, "QUEUED", []),
                                        (3, "FAILED", [])):
            db.execute(text(
                "INSERT INTO jobs (id, version, owner_id, name, experiment, status, mode, "
                "num_csx, priority, max_failures, failures, attempt, tags, params, systems, "
                "created_at, started_at) VALUES (:id, 1, 1, :name, 'csx-sparse', :status, "
                "'train', 1, 0, 3, 0, 1, '{}', :params, :systems, :now, :started)"),
                {"id": job_id, "name": f"job{job_id}", "status": status,
                 "params": json.dumps(FIRST_RELEASE_PARAMS), "systems": json.dumps(systems),
                 "now": now, "started": now if status == "RUNNING" else None})
            db.execute(text("INSERT INTO job_events (job_id, to_status, attempt, at) "
                            "VALUES (:id, :status, 1, :now)"),
                       {"id": job_id, "status": status, "now": now})
        db.execute(text("INSERT INTO studies (id, owner_id, name, experiment, request, "
                        "created_at) VALUES (1, 1, 's', 'csx-sparse', :request, :now)"),
                   {"request": json.dumps({"name": "s", "params": FIRST_RELEASE_PARAMS,
                                           "algorithms": ["rigl"], "sparsity": 0.8}),
                    "now": now})
    engine.dispose()
    return secret


def test_an_upgrade_from_the_first_release_keeps_the_queue_running(
        service_settings: Settings, launcher: ScriptedLauncher) -> None:
    secret = _first_release_database(service_settings.database_url)
    alice = {"Authorization": f"Bearer {secret}"}
    with TestClient(create_app(service_settings, launcher=launcher)) as client:
        resumed = launcher.handle_for(1)  # the running job, adopted from its checkpoint
        queued = launcher.handle_for(2)
        wait_status(client, alice, 1, "RUNNING")
        wait_status(client, alice, 2, "RUNNING")
        events = client.get("/v1/jobs/1/events", headers=alice).json()["data"]
        assert [e["to_status"] for e in events] == ["RUNNING", "RECOVERING", "RUNNING"], events
        retried = client.post("/v1/jobs/3:retry", headers=alice)
        assert retried.status_code == 202, retried.text
        launcher.handle_for(3)
        for handle in (resumed, queued):
            handle.finish({})
        wait_for(lambda: all(client.get(f"/v1/jobs/{i}", headers=alice).json()["status"]
                             == "SUCCEEDED" for i in (1, 2)), 30, "both jobs to succeed")
        params = client.get("/v1/jobs/2", headers=alice).json()["params"]
    spec = JobSpec.model_validate(params)
    assert spec.optimizer.optimizer_type == "SGD" and spec.optimizer.momentum == 0.9
    assert spec.model.preset == "tiny" and spec.model.num_hidden_layers == 3
    assert spec.train_input.max_sequence_length == 16 and spec.eval_input.shuffle is True
    for step in range(12):
        assert math.isclose(learning_rate_at(spec.optimizer.learning_rate, step),
                            0.01 * first_release_factor(3, 0.001, 0.01, 10, step), rel_tol=1e-12)
    engine = make_engine(service_settings.database_url)
    with engine.connect() as db:
        request = db.execute(text("SELECT request FROM studies WHERE id = 1")).scalar_one()
    engine.dispose()
    assert JobSpec.model_validate(json.loads(request)["params"]).optimizer.optimizer_type == "SGD"


def test_retrying_a_job_whose_stored_params_no_longer_validate_names_the_key(
        client: TestClient, alice: dict[str, str], launcher: ScriptedLauncher) -> None:
    from service.models import Job

    job_id = client.post("/v1/jobs", json=job_body(), headers=alice).json()["id"]
    launcher.handle_for(job_id).finish(RuntimeError("lost"))
    wait_status(client, alice, job_id, "FAILED")
    with client.app.state.sessionmaker() as session:
        job = session.get(Job, job_id)
        job.params = {**job.params, "optimizer": {**job.params["optimizer"], "typo": 1}}
        session.commit()
    answer = client.post(f"/v1/jobs/{job_id}:retry", headers=alice)
    assert answer.status_code == 409 and "optimizer.typo" in answer.json()["detail"]


@given(peak=st.floats(1e-4, 1.0), floor_share=st.floats(0.0, 1.0), warmup=st.integers(0, 20),
       decay=st.one_of(st.none(), st.integers(1, 50)), max_steps=st.integers(1, 60),
       preset=st.sampled_from(["tiny", None]))
def test_a_first_release_spec_converts_to_the_same_model_and_learning_rate(
        peak: float, floor_share: float, warmup: int, decay: int | None, max_steps: int,
        preset: str | None) -> None:
    migration = _migration()
    params = json.loads(json.dumps(FIRST_RELEASE_PARAMS))
    params["optimizer"]["learning_rate"] = {"type": "warmup_cosine", "peak": peak,
                                            "warmup_steps": warmup, "minimum": peak * floor_share,
                                            "decay_steps": decay}
    params["runconfig"]["max_steps"] = max_steps
    if preset is None:
        params["model"].update(preset=None, n_layer=2, n_head=4, d_model=64, d_ff=160,
                               max_seq_len=128, tie_embeddings=True)
    assert migration.is_first_release(params)
    spec = JobSpec.model_validate(migration.convert(params))
    assert not migration.is_first_release(spec.model_dump(mode="json"))
    for step in range(max_steps + 3):
        assert math.isclose(learning_rate_at(spec.optimizer.learning_rate, step),
                            peak * first_release_factor(warmup, peak * floor_share, peak,
                                                        decay or max_steps, step),
                            rel_tol=1e-9, abs_tol=1e-12)
    if preset is None:  # the first release's Llama at the tiny preset's sizes: its model
        tiny = JobSpec.model_validate({"model": {"preset": "tiny"}}).model.resolved()
        assert spec.model.resolved() == tiny
