"""Runner plumbing with a small stand-in loop: gloo averaging, progress delivery, giving up
after max_failures, cancellation, error classification. The real loop: test_runner_train.py."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import ray
import ray.cloudpickle
import torch

from workers.replica import CsxWorker
from workers.runner import JobCancelled, JobFailed, MaskDivergence, run_job, start_job
from csx_config import JobSpec
from training.plan import plan_job

# The stand-in loop below runs inside Ray actors, which cannot import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.usefixtures("ray_session")

UPDATE_EVERY = 5


def linear_train(plan, *, model_dir, mode, rank, all_reduce, tracker, progress, device):
    """The contract of training.loop.train on a least-squares model: each rank takes its slice
    of the same seeded global batch, gradients are averaged, a top-k "mask" is recomputed every
    UPDATE_EVERY steps, rank 0 checkpoints, and a restart resumes from the newest checkpoint."""
    del mode, device
    global_batch = plan.data.train.batch_size
    local = global_batch // plan.num_csx
    weight = torch.zeros(16, dtype=torch.float64)
    target = torch.linspace(-1, 1, 16, dtype=torch.float64)
    start, hashes = 0, []
    checkpoints = sorted(Path(model_dir).glob("linear_*.pt"))
    if checkpoints:
        state = torch.load(checkpoints[-1])
        start, weight, hashes = state["step"], state["weight"], state["hashes"]
    for step in range(start + 1, plan.loop.max_steps + 1):
        generator = torch.Generator().manual_seed(plan.seed * 10_000 + step)
        inputs = torch.randn(global_batch, 16, generator=generator, dtype=torch.float64)
        rows = inputs[rank * local:(rank + 1) * local]
        residual = rows @ weight - rows @ target
        loss = (residual ** 2).mean().reshape(1)
        grad = 2 * rows.T @ residual / local
        if all_reduce is not None:
            all_reduce([grad, loss])
        weight = weight - 0.05 * grad
        if step % UPDATE_EVERY == 0:
            mask = torch.zeros(16, dtype=torch.bool)
            mask[weight.abs().topk(8).indices] = True
            hashes.append((step, hashlib.sha256(mask.numpy().tobytes()).hexdigest()[:16]))
            if tracker is not None:
                tracker.log_mask_update(step, {"weight": mask.reshape(4, 4)})
        if rank == 0 and plan.loop.checkpoint_steps and \
                step % plan.loop.checkpoint_steps == 0:
            torch.save({"step": step, "weight": weight, "hashes": hashes},
                       Path(model_dir) / f"linear_{step:06d}.pt")
        if tracker is not None:
            tracker.log_metrics({"train/loss": float(loss)}, step=step)
        if progress is not None and step % plan.loop.log_steps == 0:
            progress({"step": step, "loss": float(loss)})
    return {"weight": weight.tolist(), "mask_hashes": hashes, "steps": plan.loop.max_steps,
            "start_step": start}


def make_spec(**runconfig) -> JobSpec:
    settings = {"max_steps": 20, "log_steps": 1, "checkpoint_steps": 10, "seed": 3,
                "max_failures": 0, **runconfig}
    return JobSpec.model_validate({"train_input": {"batch_size": 8}, "runconfig": settings})


def test_gloo_all_reduce_between_two_actors_gives_the_mean():
    actors = [CsxWorker.remote(rank, 2) for rank in range(2)]
    try:
        port = ray.get(actors[0].free_port.remote("127.0.0.1"))
        ray.get([actor.join_group.remote("127.0.0.1", port) for actor in actors])

        def reduce_rank_values(plan, *, rank, all_reduce, **_):
            values = [torch.full((3, 2), float(rank + 1)), torch.arange(4.0, dtype=torch.float64)
                      * (rank + 1), torch.tensor([10.0 * rank])]
            all_reduce(values)
            return {"values": [v.tolist() for v in values]}

        results = ray.get([actor.train.remote(None, model_dir="", mode="train",
                                              tracker_args=None, relay=None,
                                              train_fn=reduce_rank_values)
                           for actor in actors])
    finally:
        for actor in actors:
            ray.kill(actor)
    for result in results:
        assert result["values"] == [[[1.5, 1.5]] * 3, [0.0, 1.5, 3.0, 4.5], [5.0]]
        assert result["comm/allreduce_calls"] == 1


def test_worker_loss_beyond_max_failures_fails_the_job_and_its_run(tmp_path, tracking_uri):
    def kill_rank_1(event):
        if event.get("step") == 3:
            os.kill(handle.worker_pids()[1], signal.SIGKILL)

    handle = start_job(plan_job(make_spec(), 2, max_failures=0), model_dir=str(tmp_path),
                       tracking_uri=tracking_uri, train_fn=linear_train, progress=kill_rank_1)
    with pytest.raises(JobFailed, match="max_failures=0"):
        handle.wait()
    from mlflow import MlflowClient
    assert MlflowClient(tracking_uri=tracking_uri).get_run(handle.run_id).info.status == "FAILED"


def test_an_error_in_the_loop_is_raised_as_is_without_restarts(tmp_path):
    def broken_train(plan, *, rank, **_):
        if rank == 1:
            raise ValueError("optimizer.type 'Adum' is not a torch.optim class")
        return {}

    handle = start_job(plan_job(make_spec(), 2, max_failures=3), model_dir=str(tmp_path), tracking=False,
                       train_fn=broken_train)
    with pytest.raises(ValueError, match="Adum"):
        handle.wait()
    assert handle.attempts == 1


def test_diverging_masks_are_refused_naming_the_step(tmp_path):
    def diverging_train(plan, *, rank, **_):
        return {"mask_hashes": [(5, "aa"), (10, "bb" if rank == 0 else "cc")]}

    with pytest.raises(MaskDivergence, match="step 10: rank 0 has .*'bb'.* rank 1 has .*'cc'"):
        run_job(plan_job(make_spec(), 2), model_dir=str(tmp_path), tracking=False, train_fn=diverging_train)


def test_cancel_kills_every_actor(tmp_path, tracking_uri):
    pids, steps = [], []

    def cancel_at_step_2(event):
        steps.append(event["step"])
        if event["step"] == 2:
            pids.extend(handle.worker_pids())
            handle.cancel()

    handle = start_job(plan_job(make_spec(max_steps=10_000), 2), model_dir=str(tmp_path),
                       tracking_uri=tracking_uri, train_fn=linear_train, progress=cancel_at_step_2)
    with pytest.raises(JobCancelled):
        handle.wait()
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert steps == [1, 2]  # in order, and rank 0 waited for the callback before step 3
    assert len(pids) == 2 and not any(pid_alive(pid) for pid in pids)
    from mlflow import MlflowClient
    assert MlflowClient(tracking_uri=tracking_uri).get_run(handle.run_id).info.status == "KILLED"


def test_a_mode_the_loop_lacks_is_refused(tmp_path):
    with pytest.raises(ValueError, match="mode must be one of"):
        start_job(plan_job(make_spec(), 1), mode="fit", model_dir=str(tmp_path), tracking=False)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child of the raylet may linger as a zombie until reaped; it may also be reaped
    # between the kill(0) above and this read (ESRCH or ENOENT from /proc)
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
