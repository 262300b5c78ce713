"""The scheduler on a 4-system cluster, driven through the API with a scripted launcher."""

from __future__ import annotations

import threading

from fastapi.testclient import TestClient

from service import run_tags
from service.main import create_app
from service.models import Job
from service.settings import Settings
from service.states import JobStatus, move
from workers.hardware import ClusterSummary
from service_helpers import (
    ScriptedLauncher,
    job_body,
    job_folder,
    make_token,
    wait_for,
    wait_status,
)


def _submit(client: TestClient, headers: dict[str, str], **options: object) -> int:
    response = client.post("/v1/jobs", json=job_body(**options), headers=headers)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _statuses(client: TestClient, headers: dict[str, str], job_id: int) -> list[str]:
    events = client.get(f"/v1/jobs/{job_id}/events", headers=headers).json()["data"]
    return [e["to_status"] for e in events]


def test_job_runs_to_success_through_every_state(client: TestClient, alice: dict[str, str],
                                                 launcher: ScriptedLauncher) -> None:
    job_id = _submit(client, alice, num_csx=2, mode="train_and_eval")
    handle = launcher.handle_for(job_id)
    running = wait_status(client, alice, job_id, "RUNNING")
    assert running["systems"] == [0, 1] and running["started_at"] is not None
    assert handle.plan.num_csx == 2 and handle.kwargs["mode"] == "train_and_eval"
    assert handle.kwargs["model_dir"] == str(
        job_folder(client, client.app.state.settings.runs_dir, job_id) / "model")
    plan = client.get(f"/v1/jobs/{job_id}", headers=alice).json()["plan"]
    assert plan, "VALIDATING stores the plan's report"
    handle.kwargs["progress"]({"step": 5, "max_steps": 10, "loss": 2.5})
    wait_for(lambda: client.get(f"/v1/jobs/{job_id}", headers=alice).json()["progress"],
             what="progress")
    handle.finish({"final_eval_perplexity": 7.5, "steps": 10})
    done = wait_status(client, alice, job_id, "SUCCEEDED")
    assert done["result"]["final_eval_perplexity"] == 7.5 and done["systems"] == []
    assert _statuses(client, alice, job_id) == ["QUEUED", "VALIDATING", "PROVISIONING",
                                                "RUNNING", "SUCCEEDED"]
    logs = client.get(f"/v1/jobs/{job_id}/logs", headers=alice).text
    assert '"step": 5' in logs and "SUCCEEDED" in logs


def test_jobs_wait_for_free_systems_and_hold_them(client: TestClient, alice: dict[str, str],
                                                  launcher: ScriptedLauncher) -> None:
    big = _submit(client, alice, num_csx=4)
    wait_status(client, alice, big, "RUNNING")
    small = _submit(client, alice, num_csx=1)
    cluster = client.get("/v1/cluster", headers=alice).json()
    assert cluster["free"] == 0 and {s["job_id"] for s in cluster["systems"]} == {big}
    assert client.get(f"/v1/jobs/{small}", headers=alice).json()["status"] == "QUEUED"
    launcher.handle_for(big).finish({})
    wait_status(client, alice, small, "RUNNING")
    assert client.get("/v1/cluster", headers=alice).json()["free"] == 3


def test_a_job_waits_for_cpus_in_order_when_its_systems_are_free(
        client: TestClient, alice: dict[str, str], launcher: ScriptedLauncher) -> None:
    """Two systems of two CPUs each: a 1-system job trains on all four CPUs by default, so the
    next one waits QUEUED (not RUNNING behind Ray, where a later job could overtake it) though
    a system is free; jobs that name cpus_per_csx share the cluster."""
    client.app.state.settings.read_cluster_from(lambda: ClusterSummary(
        systems=2, nodes=1, cpus_per_system=2.0, gpus_per_system=0.0,
        memory_per_system_bytes=8.0 * 2**30))
    first, second = _submit(client, alice), _submit(client, alice)
    wait_status(client, alice, first, "RUNNING")
    third = _submit(client, alice, runconfig={"max_steps": 10, "cpus_per_csx": 2})
    cluster = client.get("/v1/cluster", headers=alice).json()
    assert cluster["free"] == 1 and cluster["queued"] == 2
    assert not launcher.launches_of(second) and not launcher.launches_of(third)
    launcher.handle_for(first).finish({})
    wait_status(client, alice, second, "RUNNING")  # the head goes first, as submitted
    assert client.get(f"/v1/jobs/{third}", headers=alice).json()["status"] == "QUEUED"
    launcher.handle_for(second).finish({})
    wait_status(client, alice, third, "RUNNING")
    fourth = _submit(client, alice, runconfig={"max_steps": 10, "cpus_per_csx": 2})
    wait_status(client, alice, fourth, "RUNNING")  # 2 + 2 CPUs: both fit
    for job in (third, fourth):
        launcher.handle_for(job).finish({})
        wait_status(client, alice, job, "SUCCEEDED")


def test_priority_then_fifo_order(client: TestClient, alice: dict[str, str],
                                  launcher: ScriptedLauncher) -> None:
    settings = client.app.state.settings
    settings.paused = True
    first_low = _submit(client, alice, num_csx=4, priority=0)
    second_low = _submit(client, alice, num_csx=4, priority=0)
    high = _submit(client, alice, num_csx=4, priority=9)
    settings.paused = False
    client.app.state.scheduler.wake()
    order = []
    for _ in range(3):
        running = wait_for(lambda: [j for j in (first_low, second_low, high)
                                    if j not in order and launcher.launches_of(j)], what="launch")
        assert len(running) == 1, "only one 4-system job fits at a time"
        order.append(running[0])
        wait_status(client, alice, running[0], "RUNNING")
        launcher.handle_for(running[0]).finish({})
    assert order == [high, first_low, second_low]


def test_cancel_running_and_queued_jobs(client: TestClient, alice: dict[str, str],
                                        launcher: ScriptedLauncher) -> None:
    running = _submit(client, alice, num_csx=4)
    wait_status(client, alice, running, "RUNNING")
    queued = _submit(client, alice, num_csx=4)
    response = client.post(f"/v1/jobs/{queued}:cancel", headers=alice)
    assert response.status_code == 202 and response.json()["status"] == "CANCELLED"
    response = client.post(f"/v1/jobs/{running}:cancel", headers=alice)
    assert response.status_code == 202 and response.json()["status"] == "CANCELLING"
    wait_status(client, alice, running, "CANCELLED")
    assert launcher.handle_for(running).cancelled.is_set()
    assert _statuses(client, alice, running)[-2:] == ["CANCELLING", "CANCELLED"]
    again = client.post(f"/v1/jobs/{running}:cancel", headers=alice)
    assert again.status_code == 409 and "CANCELLED" in again.json()["detail"]
    assert client.post(f"/v1/jobs/{running}:retry", headers=alice).status_code == 409


def test_timeout_fails_the_job(client: TestClient, alice: dict[str, str],
                               launcher: ScriptedLauncher) -> None:
    job_id = _submit(client, alice, timeout_s=0.3)
    failed = wait_status(client, alice, job_id, "FAILED")
    assert failed["status_message"].startswith("TIMEOUT")
    assert launcher.handle_for(job_id).cancelled.is_set()


def test_recovering_follows_worker_loss_events(client: TestClient, alice: dict[str, str],
                                               launcher: ScriptedLauncher) -> None:
    job_id = _submit(client, alice, max_failures=2)
    handle = launcher.handle_for(job_id)
    wait_status(client, alice, job_id, "RUNNING")
    handle.kwargs["progress"]({"event": "recovering", "failures": 1, "error": "actor died"})
    recovering = wait_status(client, alice, job_id, "RECOVERING")
    assert recovering["failures"] == 1 and "actor died" in recovering["status_message"]
    handle.kwargs["progress"]({"step": 3, "max_steps": 10})
    wait_status(client, alice, job_id, "RUNNING")
    assert handle.plan.max_failures == 2
    handle.finish({})
    wait_status(client, alice, job_id, "SUCCEEDED")


def test_failure_then_retry_reuses_the_mlflow_run(client: TestClient, alice: dict[str, str],
                                                  launcher: ScriptedLauncher) -> None:
    launcher.create_runs = True
    job_id = _submit(client, alice)
    first = launcher.handle_for(job_id)
    first.finish(RuntimeError("gloo exploded"))
    failed = wait_status(client, alice, job_id, "FAILED")
    assert failed["status_message"] == (f"RuntimeError: gloo exploded "
                                        f"(details: GET /v1/jobs/{job_id}/logs)")
    assert failed["mlflow_run_id"] == first.run_id and failed["mlflow_url"].endswith(first.run_id)
    retried = client.post(f"/v1/jobs/{job_id}:retry", headers=alice)
    assert retried.status_code == 202 and retried.json()["attempt"] == 2
    second = launcher.handle_for(job_id, launch=2)
    assert second.kwargs["mlflow_run_id"] == first.run_id
    second.finish({})
    assert wait_status(client, alice, job_id, "SUCCEEDED")["attempt"] == 2
    from mlflow.tracking import MlflowClient

    assert run_tags.flush(client.app.state.settings.mlflow_tracking_uri)
    tags = MlflowClient(client.app.state.settings.mlflow_tracking_uri).get_run(first.run_id).data.tags
    assert tags["csx.status"] == "SUCCEEDED"


def test_hardware_only_keys_are_reported_once_as_not_applied(client: TestClient, alice: dict[str, str],
                                                          launcher: ScriptedLauncher) -> None:
    job_id = _submit(client, alice, runconfig={"max_steps": 10, "use_cs_grad_accum": True},
                     train_input={"batch_size": 8, "max_sequence_length": 16, "num_workers": 2})
    wait_status(client, alice, job_id, "RUNNING")
    events = client.get(f"/v1/jobs/{job_id}/events", headers=alice).json()["data"]
    notes = [e["message"] for e in events if "not applied here" in (e["message"] or "")]
    assert len(notes) == 1, events
    assert "train_input.num_workers" in notes[0] and "runconfig.use_cs_grad_accum" in notes[0]
    launcher.handle_for(job_id).finish({})


def test_deep_validation_failure_names_the_reason(client: TestClient, alice: dict[str, str],
                                                  launcher: ScriptedLauncher) -> None:
    job_id = _submit(client, alice, optimizer={"optimizer_type": "NoSuchOptimizer"})
    failed = wait_status(client, alice, job_id, "FAILED")
    assert failed["status_message"].startswith("ValueError: invalid job")
    assert "NoSuchOptimizer" in failed["status_message"]
    assert not launcher.launches_of(job_id)


def test_restart_resumes_holding_jobs_and_keeps_queue(service_settings: Settings) -> None:
    """States left by a dead process: resumable ones come back as RECOVERING and relaunch."""
    service_settings.paused = True
    with TestClient(create_app(service_settings, launcher=ScriptedLauncher())) as client:
        alice = make_token(client, "alice")
        ids = {name: _submit(client, alice) for name in ("running", "validating", "cancelling",
                                                         "queued")}
        with client.app.state.sessionmaker() as session:
            for name, path in {"running": ["VALIDATING", "PROVISIONING", "RUNNING"],
                               "validating": ["VALIDATING"],
                               "cancelling": ["VALIDATING", "CANCELLING"]}.items():
                job = session.get(Job, ids[name])
                job.systems = [0] if name == "running" else []
                for status in path:
                    move(session, job, JobStatus(status))
            session.commit()
    launcher = ScriptedLauncher()
    with TestClient(create_app(service_settings, launcher=launcher)) as client:
        status = {n: client.get(f"/v1/jobs/{i}", headers=alice).json()["status"]
                  for n, i in ids.items()}
        handle = launcher.handle_for(ids["running"])
        wait_status(client, alice, ids["running"], "RUNNING")
        assert status["validating"] == "QUEUED" and status["queued"] == "QUEUED"
        assert status["cancelling"] == "CANCELLED"
        assert _statuses(client, alice, ids["running"])[-2:] == ["RECOVERING", "RUNNING"]
        assert handle.kwargs["model_dir"] == str(
            job_folder(client, service_settings.runs_dir, ids["running"]) / "model")
        assert len(launcher.handles) == 1, "paused: only the resumed job runs"


def test_a_job_whose_node_left_goes_back_to_the_queue_and_frees_the_rest(
        client: TestClient, alice: dict[str, str], launcher: ScriptedLauncher) -> None:
    """One of two nodes dies under a 2-system job: the job used to wait for it (up to its
    timeout, a day by default) holding both systems, /v1/cluster said `free -1`, and a
    1-system job stayed QUEUED beside the idle node."""
    from dataclasses import replace

    settings = client.app.state.settings
    two_nodes = replace(settings.cluster(), systems=2, nodes=2)
    settings.read_cluster_from(lambda: two_nodes)
    big = _submit(client, alice, num_csx=2)
    first = launcher.handle_for(big)
    wait_status(client, alice, big, "RUNNING")
    one_node = replace(two_nodes, systems=1, nodes=1)
    settings.read_cluster_from(lambda: one_node)  # the node is gone, and its worker with it
    first.kwargs["progress"]({"event": "recovering", "failures": 1, "error": "node lost"})
    small = _submit(client, alice, num_csx=1)
    requeued = wait_status(client, alice, big, "QUEUED")
    assert first.cancelled.is_set() and requeued["systems"] == []
    assert "node" in requeued["status_message"]
    wait_status(client, alice, small, "RUNNING")
    cluster = client.get("/v1/cluster", headers=alice).json()
    assert (cluster["size"], cluster["free"], cluster["queued"]) == (1, 0, 1)
    settings.read_cluster_from(lambda: two_nodes)  # the node is back
    launcher.handle_for(small).finish({})
    launcher.handle_for(big, launch=2).finish({})
    assert wait_status(client, alice, big, "SUCCEEDED")["attempt"] == 1
    assert _statuses(client, alice, big)[-6:] == [
        "RECOVERING", "QUEUED", "VALIDATING", "PROVISIONING", "RUNNING", "SUCCEEDED"]


def test_a_cancel_racing_the_jobs_start_still_cancels_it(
        client: TestClient, alice: dict[str, str], monkeypatch) -> None:
    """Cancel-all of a long queue: the scheduler started a job between a cancel's read and its
    write; the cancel answered 409 and the job ran on. A second cancel of a job already
    stopping answered 409 too."""
    from service.api.routes import jobs as routes

    client.app.state.settings.paused = True  # the job starts only when the test says so
    job_id = _submit(client, alice)
    real_move = routes.move

    def scheduler_first(session, job, target, **options):
        monkeypatch.setattr(routes, "move", real_move)
        with client.app.state.scheduler.sessions() as other:  # the scheduler's start
            started = other.get(Job, job.id)
            started.systems = [0]
            real_move(other, started, JobStatus.VALIDATING, message="systems [0] reserved")
            other.commit()
        return real_move(session, job, target, **options)

    monkeypatch.setattr(routes, "move", scheduler_first)
    # No scheduler pass between the two cancels: the job has no execution, so the next pass
    # cancels it at once, and a second cancel of a CANCELLED job rightly answers 409. A pass
    # that is a no-op has run once the tick in progress, if any, ended.
    scheduler = client.app.state.scheduler
    passed = threading.Event()
    monkeypatch.setattr(scheduler, "tick", passed.set)
    scheduler.wake()
    assert passed.wait(30), "the scheduler made no pass"
    answer = client.post(f"/v1/jobs/{job_id}:cancel", headers=alice)
    assert answer.status_code == 202 and answer.json()["status"] == "CANCELLING", answer.text
    again = client.post(f"/v1/jobs/{job_id}:cancel", headers=alice)
    assert again.status_code == 202, again.text
    monkeypatch.delattr(scheduler, "tick")  # the class's again: the stop is forwarded
    scheduler.wake()
    wait_status(client, alice, job_id, "CANCELLED")
    assert _statuses(client, alice, job_id) == ["QUEUED", "VALIDATING", "CANCELLING",
                                                "CANCELLED"]
