"""File faults (issue 32, items 7-9) against the real scheduler, API and training loop: what
state each reaches, how long it takes, what is lost.

One process, a fresh SQLite database, the service app through its test client. Jobs run
`training.loop.train` itself in the scheduler's job thread (no Ray: these faults are about
files, bench/recovery.py kills processes). A tiny RigL spec, 6 steps, a checkpoint every 2.

1. disk full: from step 6 every write to the job's folder fails with a real ENOSPC (the
   checkpoint's temporary file is /dev/full, the job log's opening fails): the job must end
   FAILED naming ENOSPC and the checkpoint, not stay RUNNING.
2. checkpoint_4 truncated, then `:retry`: the job must resume from checkpoint_2, end SUCCEEDED,
   and its final state must equal an uninterrupted run's, bit for bit.
3. every checkpoint damaged, then `:retry`: FAILED, the reason naming the files.
4. `job.log` replaced by a link to /etc/shadow: the logs route must not serve it.
5. a checkpoint linked to another user's: `checkpoint: {job, step}` must be refused (422).
6. a FIFO named `*.txt`, and a `*.txt` link to /dev/zero, in a data folder: refused at once.

    python bench/file_faults.py      # prints the table, writes bench/results/file_faults.json
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "service"), str(ROOT / "tests" / "workers")]  # helpers
from service_helpers import job_folder, make_token, wait_status  # noqa: E402
from training_helpers import memory_headroom, same_state  # noqa: E402

from record import write_json  # noqa: E402  (bench/ is on sys.path as a script)

RESULTS = ROOT / "bench" / "results" / "file_faults.json"
PARAMS = {
    "train_input": {"batch_size": 4, "max_sequence_length": 16},
    "eval_input": {"batch_size": 4, "max_sequence_length": 16},
    "model": {"preset": "tiny"},
    "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1.0e-3},
    "sparsity": {"algorithm": "rigl", "sparsity": 0.75, "update": {"freq": 2}, "drop_fraction": 0.3},
    "runconfig": {"max_steps": 6, "checkpoint_steps": 2, "log_steps": 2, "eval_steps": 1,
                  "seed": 0, "mlflow_experiment": "", "sparse_kernel": "dense"},
}
DEADLINE_S = 300.0


class InProcessHandle:
    """A job run by the training loop itself, in the scheduler's job thread."""

    run_id = None

    def __init__(self, plan: Any, kwargs: dict[str, Any]) -> None:
        self.plan, self.kwargs = plan, kwargs

    def wait(self) -> dict[str, Any]:
        from training.loop import train

        return train(self.plan, model_dir=self.kwargs["model_dir"], mode=self.kwargs["mode"],
                     progress=self.kwargs["progress"])

    def cancel(self) -> None:
        """No job here is cancelled or times out."""


@contextmanager
def disk_full(checkpoint_step: int) -> Iterator[None]:
    """Checkpoint `checkpoint_step` is written to /dev/full (a real ENOSPC from the kernel),
    and meanwhile no job log can be opened (ENOSPC)."""
    import training.checkpoint as ckpt
    from service import joblogs

    real_mkstemp, real_open_log = tempfile.mkstemp, joblogs._open_for_append

    def mkstemp(**kwargs: Any) -> tuple[int, str]:
        handle, name = real_mkstemp(**kwargs)
        if Path(name).name.startswith(f".checkpoint_{checkpoint_step}.mdl."):
            full = os.open("/dev/full", os.O_WRONLY)
            os.dup2(full, handle)
            os.close(full)
        return handle, name

    def open_log(path: Path) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    ckpt.tempfile.mkstemp, joblogs._open_for_append = mkstemp, open_log
    try:
        yield
    finally:
        ckpt.tempfile.mkstemp, joblogs._open_for_append = real_mkstemp, real_open_log


def _timed(call: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    return call(), round(time.perf_counter() - started, 3)


def _within_deadline(call: Any, deadline_s: float = 60.0) -> tuple[str, float]:
    """('refused: ...' | 'read' | 'BLOCKED', seconds)."""
    outcome: list[str] = []

    def run() -> None:
        try:
            call()
            outcome.append("read")
        except ValueError as err:
            outcome.append(f"refused: {err}")

    started = time.perf_counter()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(deadline_s)
    return (outcome[0] if outcome else "BLOCKED"), round(time.perf_counter() - started, 3)


def run_faults() -> tuple[list[dict[str, Any]], bool]:
    """(one row per fault, whether each was handled as it must be)."""
    import torch
    from fastapi.testclient import TestClient

    from service.main import create_app
    from service.settings import Settings
    from training import checkpoint as ckpt
    from training.text import load_splits

    torch.set_num_threads(1)
    logging.getLogger("service.joblogs").setLevel(logging.ERROR)  # the full disk's, expected
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="csx-file-faults-") as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        settings = Settings(database_url=f"sqlite:///{root / 'csx.db'}", runs_dir=root / "runs",
                            mlflow_tracking_uri=f"sqlite:///{root / 'mlflow.db'}",
                            allowed_data_roots=[root / "data"], cluster_size=1,
                            scheduler_interval_s=0.05)
        launcher = lambda plan, **kwargs: InProcessHandle(plan, kwargs)  # noqa: E731
        with TestClient(create_app(settings, launcher=launcher)) as client:
            alice, bob = make_token(client, "alice"), make_token(client, "bob")

            def submit(headers: dict[str, str], **options: Any) -> Any:
                return client.post("/v1/jobs", json={"params": PARAMS, **options}, headers=headers)

            # An uninterrupted run: the reference final state.
            reference = submit(alice).json()["id"]
            wait_status(client, alice, reference, "SUCCEEDED", timeout_s=DEADLINE_S)
            reference_final = ckpt.load_checkpoint(
                job_folder(client, settings.runs_dir, reference) / "model" / "checkpoint_6.mdl")

            def fails_on_a_full_disk() -> tuple[int, dict[str, Any], float]:
                """A job whose checkpoint_6 meets a full disk: checkpoints 2 and 4 stay."""
                with disk_full(checkpoint_step=6):
                    job = submit(alice).json()["id"]
                    failed, seconds = _timed(lambda: wait_status(client, alice, job, "FAILED",
                                                                 timeout_s=DEADLINE_S))
                return job, failed, seconds

            # 1. The disk is full at step 6.
            job, failed, seconds = fails_on_a_full_disk()
            folder = job_folder(client, settings.runs_dir, job)
            rows.append({"fault": "ENOSPC writing checkpoint_6 and the job log",
                         "state": failed["status"], "reason": failed["status_message"],
                         "seconds_to_state": seconds, "lost": "steps 5-6 (not checkpointed)"})

            # 2. checkpoint_4 truncated, then :retry.
            newest = folder / "model" / "checkpoint_4.mdl"
            newest.write_bytes(newest.read_bytes()[:newest.stat().st_size // 2])
            client.post(f"/v1/jobs/{job}:retry", headers=alice)
            done, seconds = _timed(lambda: wait_status(client, alice, job, "SUCCEEDED",
                                                       timeout_s=DEADLINE_S))
            final = ckpt.load_checkpoint(folder / "model" / "checkpoint_6.mdl")
            identical = all(same_state(final[key], reference_final[key])
                            for key in ("model", "optimizer", "sparsity", "lr_scheduler",
                                        "data_position", "step"))
            rows.append({"fault": ":retry with the newest checkpoint (4) truncated",
                         "state": done["status"],
                         "resumed_from": f"checkpoint_{done['result']['train_losses'][0][0] - 1}",
                         "skipped": len(done["result"].get("skipped_checkpoints", [])),
                         "seconds_to_state": seconds,
                         "lost": "nothing: final state bit-identical" if identical
                         else "FINAL STATE DIFFERS"})

            # 3. Every checkpoint damaged, then :retry.
            doomed, _, _ = fails_on_a_full_disk()
            for _, path in ckpt.list_checkpoints(job_folder(client, settings.runs_dir, doomed) / "model"):
                path.write_bytes(b"")
            client.post(f"/v1/jobs/{doomed}:retry", headers=alice)
            failed, seconds = _timed(lambda: wait_status(client, alice, doomed, "FAILED",
                                                         timeout_s=DEADLINE_S))
            rows.append({"fault": ":retry with every checkpoint emptied", "state": failed["status"],
                         "reason": failed["status_message"], "seconds_to_state": seconds,
                         "lost": "the run (nothing valid to resume)"})

            # 4. job.log -> /etc/shadow.
            log = folder / "job.log"
            log.unlink()
            log.symlink_to("/etc/shadow")
            answer, seconds = _timed(lambda: client.get(f"/v1/jobs/{job}/logs", headers=alice))
            rows.append({"fault": "job.log -> /etc/shadow", "state": f"HTTP {answer.status_code}",
                         "reason": answer.text.strip()[:200], "seconds_to_state": seconds,
                         "lost": "nothing"})

            # 5. A checkpoint linked to another user's.
            bobs = submit(bob).json()["id"]
            wait_status(client, bob, bobs, "SUCCEEDED", timeout_s=DEADLINE_S)
            bobs_checkpoint = job_folder(client, settings.runs_dir, bobs) / "model" / "checkpoint_6.mdl"
            planted = folder / "model" / "checkpoint_8.mdl"
            planted.symlink_to(bobs_checkpoint)
            answer, seconds = _timed(lambda: submit(alice, mode="eval", checkpoint={"job": job}))
            rows.append({"fault": "checkpoint_8.mdl -> another user's checkpoint",
                         "state": f"HTTP {answer.status_code}",
                         "reason": json.dumps(answer.json().get("detail"))[:200],
                         "seconds_to_state": seconds, "lost": "nothing"})

        # 6. Special files in a data folder.
        corpus = root / "data" / "corpus"
        corpus.mkdir()
        for name in "abc":
            (corpus / f"{name}.txt").write_text(f"text {name}\n" * 50)
        os.mkfifo(corpus / "stream.txt")
        state, seconds = _within_deadline(lambda: load_splits(str(corpus)))
        rows.append({"fault": "FIFO stream.txt in a data folder", "state": state[:200],
                     "seconds_to_state": seconds, "lost": "nothing"})
        (corpus / "stream.txt").unlink()
        (corpus / "endless.txt").symlink_to("/dev/zero")
        with memory_headroom(1 << 30):  # were it read, a MemoryError, not the machine's memory
            state, seconds = _within_deadline(lambda: load_splits(str(corpus)))
        rows.append({"fault": "endless.txt -> /dev/zero in a data folder", "state": state[:200],
                     "seconds_to_state": seconds, "lost": "nothing"})
        shutil.rmtree(corpus)

    sound = (rows[0]["state"] == "FAILED" and "ENOSPC" in rows[0]["reason"]
             and rows[1]["lost"].startswith("nothing") and rows[1]["resumed_from"] == "checkpoint_2"
             and rows[2]["state"] == "FAILED" and "root:" not in rows[3]["reason"]
             and rows[4]["state"] == "HTTP 422"
             and all(r["state"].startswith("refused") for r in rows[5:]))
    return rows, sound


def table_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row in bench/service_faults.py's columns: `lost` says what a fault costs by design
    (steps not checkpointed, a run with nothing valid left); stuck is a job or read still going
    at the deadline; no file fault runs a job twice."""
    state = row["state"]
    return {"fault": row["fault"], "state": state[:60], "recover_s": row["seconds_to_state"],
            "lost": row["lost"], "stuck": int(state in ("RUNNING", "BLOCKED")),
            "double_run": 0,
            "bad_5xx": int(state.startswith("HTTP 5") and state != "HTTP 503")}


def main() -> int:
    load_at_start = os.getloadavg()
    rows, sound = run_faults()
    write_json(RESULTS, {"meets_target": sound, "faults": rows}, load_at_start=load_at_start)
    for row in rows:
        detail = row.get("reason") or row.get("resumed_from") or ""
        print(f"{row['fault']:<55} {row['state'][:60]:<60} {row['seconds_to_state']:>7} s  "
              f"lost: {row['lost']}  {detail}")
    print(f"every file fault handled: {'yes' if sound else 'NO'}")
    return 0 if sound else 1


if __name__ == "__main__":
    sys.exit(main())
