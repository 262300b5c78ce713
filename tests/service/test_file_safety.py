"""Files in job folders (issue 32, items 8 and 9): a link or FIFO planted as a job's log is
neither served nor written through, a checkpoint linked to another user's is refused naming
the file, and a job on a full disk ends FAILED naming ENOSPC instead of hanging RUNNING."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service import joblogs
from service.settings import Settings
from service_helpers import ScriptedLauncher, job_body, job_folder, wait_status
from training.safe_files import os_error

DEADLINE_S = 60  # far beyond an answer's milliseconds; the old code blocked for good


def _running_job(client: TestClient, headers: dict[str, str], launcher: ScriptedLauncher,
                 settings: Settings) -> tuple[int, Path]:
    job_id = client.post("/v1/jobs", json=job_body(), headers=headers).json()["id"]
    launcher.handle_for(job_id)
    wait_status(client, headers, job_id, "RUNNING")
    return job_id, job_folder(client, settings.runs_dir, job_id)


def _queued_job(client: TestClient, headers: dict[str, str], settings: Settings) -> tuple[int, Path]:
    client.app.state.settings.paused = True
    job_id = client.post("/v1/jobs", json=job_body(), headers=headers).json()["id"]
    folder = job_folder(client, settings.runs_dir, job_id)
    folder.mkdir(parents=True, exist_ok=True)
    return job_id, folder


def _within_deadline(call):
    """call()'s result, run in a thread; fails if it is still blocked at the deadline."""
    results = []
    worker = threading.Thread(target=lambda: results.append(call()), daemon=True)
    worker.start()
    worker.join(DEADLINE_S)
    assert not worker.is_alive(), f"still blocked after {DEADLINE_S} s"
    return results[0]


def test_a_log_linked_out_of_the_job_folder_is_neither_served_nor_written(
        client: TestClient, alice: dict[str, str], service_settings: Settings,
        tmp_path: Path) -> None:
    job_id, folder = _queued_job(client, alice, service_settings)
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$secret-hash:19000:0:99999:7:::\n")
    joblogs.log_path(folder).symlink_to(secret)
    answer = _within_deadline(lambda: client.get(f"/v1/jobs/{job_id}/logs", headers=alice))
    assert answer.status_code == 200
    assert "secret-hash" not in answer.text
    assert answer.text == "job.log is not served: it links out of its folder\n"
    joblogs.append(folder, "a line the scheduler writes")
    assert secret.read_text() == "root:$6$secret-hash:19000:0:99999:7:::\n"


def test_a_fifo_as_the_log_is_refused_at_once(client: TestClient, alice: dict[str, str],
                                              service_settings: Settings) -> None:
    job_id, folder = _queued_job(client, alice, service_settings)
    fifo = joblogs.log_path(folder)
    os.mkfifo(fifo)
    try:
        answer = _within_deadline(lambda: client.get(f"/v1/jobs/{job_id}/logs", headers=alice))
        assert answer.text == "job.log is not served: it is a named pipe (FIFO), not a regular file\n"
        _within_deadline(lambda: joblogs.append(folder, "a line the scheduler writes"))
    finally:  # a reader the old code left blocked sees end-of-file and returns
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # nobody is reading: nothing was blocked


@pytest.mark.parametrize("step", [5, None])
def test_a_checkpoint_linked_to_another_users_is_refused(
        client: TestClient, alice: dict[str, str], bob: dict[str, str],
        service_settings: Settings, step: int | None) -> None:
    client.app.state.settings.paused = True
    bobs = client.post("/v1/jobs", json=job_body(), headers=bob).json()["id"]
    bobs_checkpoint = job_folder(client, service_settings.runs_dir, bobs) / "model" / "checkpoint_5.mdl"
    bobs_checkpoint.parent.mkdir(parents=True)
    bobs_checkpoint.write_bytes(b"bob's weights")
    alices = client.post("/v1/jobs", json=job_body(), headers=alice).json()["id"]
    planted = job_folder(client, service_settings.runs_dir, alices) / "model" / "checkpoint_5.mdl"
    planted.parent.mkdir(parents=True)
    planted.symlink_to(bobs_checkpoint)
    reference = {"job": alices} if step is None else {"job": alices, "step": step}
    answer = client.post("/v1/jobs", json=job_body(mode="eval", checkpoint=reference), headers=alice)
    assert answer.status_code == 422, answer.text
    problems = [(p["loc"], p["msg"]) for p in answer.json()["detail"]]
    assert problems == [(["body", "checkpoint"],
                         f"checkpoint_5.mdl of job {alices} links out of its folder; refused")]


def test_a_job_on_a_full_disk_fails_naming_ENOSPC(client: TestClient, alice: dict[str, str],
                                                  launcher: ScriptedLauncher,
                                                  service_settings: Settings,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills while the job runs: its worker's checkpoint write fails, and so does
    every write to the job's log, which the failure path used to need first."""
    def disk_full(path: Path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(joblogs, "_open_for_append", disk_full)
    job_id, folder = _running_job(client, alice, launcher, service_settings)
    checkpoint = folder / "model" / "checkpoint_20.mdl"
    launcher.handle_for(job_id).finish(os_error(OSError(errno.ENOSPC, "torch said so"),
                                                f"writing checkpoint {checkpoint}"))
    failed = wait_status(client, alice, job_id, "FAILED")
    assert failed["status_message"].startswith(
        f"OSError: [Errno 28] No space left on device (ENOSPC) writing checkpoint "
        f"runs/{folder.name}/model/checkpoint_20.mdl")
