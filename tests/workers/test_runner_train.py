"""The runner with the real loop (training.loop): 1, 2 and 4 simulated systems train the same
model, a killed worker is replaced and the run resumes exactly, rank 0 logs to MLflow."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from urllib.parse import urlparse

import pytest
from mlflow import MlflowClient

from workers.runner import run_job, start_job
from csx_config import JobSpec
from training.plan import plan_job

pytestmark = pytest.mark.usefixtures("ray_session")

SPEC = """
train_input: {batch_size: 8, max_sequence_length: 32}
eval_input: {batch_size: 8, max_sequence_length: 32}
model: {preset: tiny}
optimizer: {optimizer_type: AdamW, learning_rate: 3.0e-3, weight_decay: 0.1, max_gradient_norm: 1.0}
sparsity: {algorithm: rigl, sparsity: 0.8, update: {freq: 5, stop: 16}, drop_fraction: 0.3}
runconfig: {max_steps: 20, checkpoint_steps: 10, log_steps: 5, seed: 0, max_failures: 0,
            mlflow_experiment: runner-test}
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tracking_uri):
    """The same job on 1, 2 and 4 systems (the 2-system one logs to MLflow)."""
    spec = JobSpec.from_yaml(SPEC)
    return {n: run_job(plan_job(spec, n), model_dir=str(tmp_path_factory.mktemp(f"csx{n}")),
                       tracking=n == 2, tracking_uri=tracking_uri)
            for n in (1, 2, 4)}


@pytest.mark.parametrize("num_csx", [2, 4])
def test_data_parallel_matches_one_system(runs, num_csx):
    single, parallel = runs[1], runs[num_csx]
    assert [step for step, _ in single["mask_hashes"]] == [0, 5, 10, 15]
    assert parallel["mask_hashes"] == single["mask_hashes"]
    assert [s for s, _ in parallel["train_losses"]] == list(range(1, 21))
    for (_, ours), (_, theirs) in zip(parallel["train_losses"], single["train_losses"]):
        assert ours == pytest.approx(theirs, abs=1e-5)
    assert parallel["num_csx"] == num_csx and parallel["restarts"] == 0


def test_rank_zero_logs_metrics_params_and_mask_artifacts(runs, tracking_uri):
    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(runs[2]["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["num_csx"] == "2" and run.data.params["algorithm"] == "rigl"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in losses] == [5, 10, 15, 20]
    artifacts = Path(urlparse(run.info.artifact_uri).path)
    assert sorted(p.name for p in (artifacts / "masks").iterdir()) == [
        "step_0000000", "step_0000005", "step_0000010", "step_0000015"]  # initial mask too
    assert run.info.run_name == "rigl" and run.data.tags["csx.algorithm"] == "rigl"
    assert (artifacts / "masks" / "step_0000010" / "masks.npz").is_file()
    assert (artifacts / "params.yaml").is_file()
    assert (artifacts / "report" / "curves.png").is_file()


def test_killed_worker_resumes_from_checkpoint_and_matches(runs, tmp_path, tracking_uri):
    killed = []

    def kill_rank_1_at_step_15(event):
        if event.get("step") == 15 and not killed:
            killed.append(handle.worker_pids()[1])
            os.kill(killed[0], signal.SIGKILL)

    handle = start_job(plan_job(JobSpec.from_yaml(SPEC), 2, max_failures=1), model_dir=str(tmp_path),
                       tracking_uri=tracking_uri, progress=kill_rank_1_at_step_15)
    summary = handle.wait()
    reference = runs[2]

    assert killed and summary["restarts"] == 1 and summary["attempts"] == 2
    assert summary["mask_hashes"] == reference["mask_hashes"]
    # the second attempt resumed from the step-10 checkpoint and ran steps 11..20
    assert [s for s, _ in summary["train_losses"]] == list(range(11, 21))
    assert [loss for _, loss in summary["train_losses"]] == pytest.approx(
        [loss for _, loss in reference["train_losses"][10:]], abs=1e-6)
    client = MlflowClient(tracking_uri=tracking_uri)
    assert client.get_run(summary["run_id"]).info.status == "FINISHED"
    final_loss = client.get_metric_history(summary["run_id"], "train/loss")[-1]
    assert final_loss.step == 20
    assert final_loss.value == pytest.approx(reference["train_loss"], abs=1e-6)
    # Every point of the uninterrupted run, none twice: the step-10 metrics the second attempt
    # resumed after reached MLflow before the kill, and steps 11-15 are not logged again.
    metrics = client.get_run(reference["run_id"]).data.metrics
    assert set(client.get_run(summary["run_id"]).data.metrics) == set(metrics)
    for key in metrics:
        expected = [m.step for m in client.get_metric_history(reference["run_id"], key)]
        steps = [m.step for m in client.get_metric_history(summary["run_id"], key)]
        assert sorted(steps) == sorted(expected), key
        assert len(set(steps)) == len(steps), key
