"""A tracker whose MLflow server stops answering mid-run.

Today's `flush` against a killed server sat 247 s in MLflow's client retries, holding the
training up, then raised: the worker died and what it had logged since the last flush was
lost. Training now goes on; what the server misses waits in the spool and is sent once it
answers, by this tracker or by a resume's.

The server's answers are scripted here (`Probe`); the store behind it is SQLite, so what was
sent can be read back.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path
from unittest.mock import patch
from urllib.parse import urlparse

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from tracking import tracker as tracker_module
from tracking.server import MLFLOW_AWAY, MLFLOW_BACK
from tracking.tracker import SPOOLED_METRICS, STAGING, Tracker, create_run, end_run

AWAY = "connection refused"


class Probe:
    """What `mlflow_unreachable` answers, and how often it was asked."""

    def __init__(self) -> None:
        self.away: str | None = None
        self.asked = 0

    def __call__(self, tracking_uri: str) -> str | None:
        self.asked += 1
        return self.away


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> Probe:
    answers = Probe()
    monkeypatch.setattr(tracker_module, "mlflow_unreachable", answers)
    monkeypatch.setattr(tracker_module, "RETRY_S", 0.2)
    return answers


def steps_of(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def artifacts_of(client: MlflowClient, run_id: str) -> Path:
    return Path(urlparse(client.get_run(run_id).info.artifact_uri).path)


def masks() -> dict[str, torch.Tensor]:
    return {"layer.weight": torch.rand(8, 4, generator=torch.Generator().manual_seed(0)) > 0.5}


def past_retry() -> None:
    time.sleep(tracker_module.RETRY_S + 0.05)  # the tracker asks an away server again after it


def test_training_goes_on_while_the_server_is_away_and_what_it_missed_arrives_later(
        tracking_uri: str, tmp_path: Path, probe: Probe) -> None:
    events: list[dict] = []
    tracker = Tracker("away", tracking_uri=tracking_uri, spool_dir=tmp_path, notify=events.append)
    client = tracker.client
    tracker.log_metrics({"train/loss": 3.0}, step=1)
    tracker.flush()

    probe.away = AWAY
    tracker.log_metrics({"train/loss": 2.0}, step=2)
    tracker.log_mask_update(2, masks())
    tracker.flush()
    asked = probe.asked
    tracker.log_metrics({"train/loss": 1.5}, step=3)
    tracker.flush()
    assert probe.asked == asked  # not asked again before RETRY_S: no request per flush
    assert events == [{"event": MLFLOW_AWAY, "reason": AWAY}]
    assert steps_of(client, tracker.run_id, "train/loss") == [1]
    spooled = [json.loads(line) for line in (tracker.spool / SPOOLED_METRICS).read_text().splitlines()]
    assert [(key, step) for key, _, _, step in spooled] == [("train/loss", 2), ("train/loss", 3)]
    tracker.flush()  # nothing new: nothing appended (each flush writes only what is new)
    assert len((tracker.spool / SPOOLED_METRICS).read_text().splitlines()) == 2
    assert (tracker.spool / "artifacts" / "masks" / "step_0000002" / "masks.npz").is_file()

    probe.away = None
    past_retry()
    tracker.flush()
    assert events[-1] == {"event": MLFLOW_BACK}
    assert steps_of(client, tracker.run_id, "train/loss") == [1, 2, 3]
    assert (artifacts_of(client, tracker.run_id) / "masks" / "step_0000002" / "masks.npz").is_file()
    assert not (tracker.spool / SPOOLED_METRICS).exists()
    assert not list((tracker.spool / "artifacts").iterdir())
    tracker.finish()
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert not tracker.spool.exists()


def test_a_resume_sends_what_the_attempt_before_it_kept(tracking_uri: str, tmp_path: Path,
                                                        probe: Probe) -> None:
    """The attempt is killed after the flush before its checkpoint, the server still away;
    the resume from that checkpoint sends the kept metrics and masks once the server is back,
    and drops the half of an artifact and the line of the spool the kill interrupted."""
    first = Tracker("resume", tracking_uri=tracking_uri, spool_dir=tmp_path)
    probe.away = AWAY
    first.log_metrics({"train/loss": 2.0}, step=1)
    first.log_mask_update(1, masks())
    first.flush()  # the loop's flush before its checkpoint
    half_written = first.spool / STAGING / "tmpkilled" / "masks.npz"
    half_written.parent.mkdir(parents=True)
    half_written.write_bytes(b"PK\x03")
    with open(first.spool / SPOOLED_METRICS, "a") as spooled:
        spooled.write('["train/loss", 1.')  # a line the kill cut short
    run_id = first.run_id
    del first  # killed

    probe.away = None  # the resume waits for the server to open the run
    resume = Tracker("resume", run_id=run_id, tracking_uri=tracking_uri, spool_dir=tmp_path)
    assert not half_written.exists()
    probe.away = AWAY  # and it leaves again
    resume.log_metrics({"train/loss": 9.0}, step=1)  # the re-run step: the first value stands
    resume.log_metrics({"train/loss": 1.0}, step=2)
    resume.flush()  # appended after the kept line, not onto the cut one
    lines = (resume.spool / SPOOLED_METRICS).read_text().splitlines()
    assert [(json.loads(line)[0], json.loads(line)[3]) for line in lines] == [
        ("train/loss", 1), ("train/loss", 2)]
    probe.away = None
    past_retry()
    resume.finish()
    client = resume.client
    history = {m.step: m.value for m in client.get_metric_history(resume.run_id, "train/loss")}
    assert history == {1: 2.0, 2: 1.0}
    assert (artifacts_of(client, resume.run_id) / "masks" / "step_0000001" / "masks.npz").is_file()
    assert not (artifacts_of(client, resume.run_id) / "tmpkilled").exists()


def test_finish_waits_for_the_server_and_then_ends_the_run(tracking_uri: str, tmp_path: Path,
                                                           probe: Probe) -> None:
    tracker = Tracker("finish", tracking_uri=tracking_uri, spool_dir=tmp_path)
    tracker.log_metrics({"train/loss": 2.0, "eval/perplexity": 7.0}, step=1)
    probe.away = AWAY
    tracker.flush()
    back = threading.Timer(0.5, lambda: setattr(probe, "away", None))
    back.start()
    started = time.monotonic()
    tracker.finish()
    assert time.monotonic() - started >= 0.5
    run = tracker.client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["final/eval_perplexity"] == 7.0
    assert (artifacts_of(tracker.client, tracker.run_id) / "report" / "curves.png").is_file()


def test_a_server_that_leaves_during_a_call_keeps_the_batch(
        tracking_uri: str, tmp_path: Path, probe: Probe, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server answered the probe and died before the batch: MLflow's client raises after
    its retries; the batch is kept. An error of a server that still answers is raised."""
    tracker = Tracker("leaves", tracking_uri=tracking_uri, spool_dir=tmp_path)
    real_log_batch = tracker.client.log_batch

    def dies(*args, **kwargs):
        probe.away = AWAY
        raise MlflowException("API request to log-batch failed: Max retries exceeded")

    monkeypatch.setattr(tracker.client, "log_batch", dies)
    tracker.log_metrics({"train/loss": 2.0}, step=1)
    tracker.flush()
    assert (tracker.spool / SPOOLED_METRICS).is_file()

    def refuses(*args, **kwargs):
        raise MlflowException("INVALID_PARAMETER_VALUE: metric key")

    probe.away = None
    past_retry()
    monkeypatch.setattr(tracker.client, "log_batch", refuses)
    with pytest.raises(MlflowException, match="INVALID_PARAMETER_VALUE"):
        tracker.flush()
    monkeypatch.setattr(tracker.client, "log_batch", real_log_batch)
    tracker.flush()
    assert steps_of(tracker.client, tracker.run_id, "train/loss") == [1]


def test_a_driver_ending_a_run_does_not_wait_for_an_away_server(tracking_uri: str,
                                                                probe: Probe) -> None:
    run_id = create_run("end-away", tracking_uri=tracking_uri)
    probe.away = AWAY
    end_run(run_id, "KILLED", tracking_uri=tracking_uri)  # returns at once, the run untouched
    client = MlflowClient(tracking_uri=tracking_uri)
    assert client.get_run(run_id).info.status == "RUNNING"
    probe.away = None
    end_run(run_id, "KILLED", tracking_uri=tracking_uri)
    assert client.get_run(run_id).info.status == "KILLED"


@settings(max_examples=40)
@given(st.lists(st.sampled_from(["log", "flush", "away", "back", "kill"]), max_size=24))
@example(["log", "away", "flush", "kill"])  # what only the spool holds
@example(["away", "log", "flush", "back", "log", "flush", "away", "log", "flush", "kill"])
def test_what_a_flush_kept_reaches_the_run_once_whatever_the_outages_and_kills(
        tracking_uri: str, ops: list[str]) -> None:
    """Any order of logged steps, flushes (the loop's, before each checkpoint), the server
    leaving and coming back, and kills resumed from the last flush: at the end every step a
    flush kept, and every step logged since, is in the run, each once."""
    probe = Probe()
    with patch.object(tracker_module, "mlflow_unreachable", probe), \
            patch.object(tracker_module, "RETRY_S", 0.0), \
            tempfile.TemporaryDirectory() as spool:
        run_id = create_run("any-order", tracking_uri=tracking_uri)
        tracker = Tracker("any-order", run_id=run_id, tracking_uri=tracking_uri, spool_dir=spool)
        step, kept, unflushed = 0, set(), set()
        for op in ops:
            if op == "log":
                step += 1
                tracker.log_metrics({"train/loss": float(step)}, step=step)
                unflushed.add(step)
            elif op == "flush":
                tracker.flush()
                kept |= unflushed
                unflushed = set()
            elif op in ("away", "back"):
                probe.away = AWAY if op == "away" else None
            else:  # killed; the resume waits for the server, then re-runs from the last flush
                probe.away, unflushed = None, set()
                tracker = Tracker("any-order", run_id=run_id, tracking_uri=tracking_uri,
                                  spool_dir=spool)
                step = max(kept, default=0)
        probe.away = None
        tracker.finish()
        history = tracker.client.get_metric_history(run_id, "train/loss")
        assert sorted(m.step for m in history) == sorted(kept | unflushed)
