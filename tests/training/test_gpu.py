"""The training loop on a CUDA device (issue 31): a seeded run starts from the CPU run's weights
and masks, the fabric runs masked dense, the precision keys apply (bf16 autocast; fp16 with
loss scaling, checkpointed and resumed). Run by `make gpu-check`; skipped without a GPU.

The loop alone, no Ray: `training.loop` imports with torch (and the repo) only.
"""

from __future__ import annotations

import math

import pytest
import torch

from csx_config import JobSpec
from training.checkpoint import checkpoint_path, load_checkpoint
from training.fabric import CALIBRATION_FILE
from training.loop import train
from training.plan import plan_job

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: the GPU tests run in `make gpu-check`")

SPEC = """
train_input: {batch_size: 8, max_sequence_length: 32}
eval_input: {batch_size: 8, max_sequence_length: 32}
model: {preset: tiny}
optimizer: {optimizer_type: AdamW, learning_rate: 3.0e-3, max_gradient_norm: 1.0}
sparsity: {algorithm: rigl, sparsity: 0.8, update: {freq: 5, stop: 16}, drop_fraction: 0.3}
runconfig: {max_steps: 10, checkpoint_steps: 5, log_steps: 5, seed: 0, mlflow_experiment: "",
            sparse_kernel: dense, torch_compile: false}
"""  # torch_compile: its own test below (compiling takes longer than these runs)
WEIGHT = "transformer_decoder.layers.0.ffn.ffn.0.linear_layer.weight"


def spec(*overrides: str) -> JobSpec:
    return JobSpec.from_yaml(SPEC, list(overrides))


def test_a_seeded_gpu_run_starts_from_the_cpu_runs_masks_and_follows_its_losses(tmp_path):
    cpu = train(plan_job(spec()), model_dir=str(tmp_path / "cpu"), device="cpu")
    gpu = train(plan_job(spec()), model_dir=str(tmp_path / "gpu"), device="cuda")
    assert gpu["device"] == "cuda" and gpu["precision"] == "float32"  # no TF32: see precision.py
    assert gpu["mask_hashes"][0] == cpu["mask_hashes"][0]  # masks drawn on the CPU, moved
    (_, first_cpu), (_, first_gpu) = cpu["train_losses"][0], gpu["train_losses"][0]
    assert first_gpu == pytest.approx(first_cpu, rel=1e-4)
    for (_, ours), (_, theirs) in zip(gpu["train_losses"], cpu["train_losses"]):
        assert ours == pytest.approx(theirs, rel=2e-2)
    assert set(gpu["kernels"].values()) == {"dense"}


def test_auto_kernel_is_masked_dense_on_cuda_without_a_cpu_calibration(tmp_path):
    summary = train(plan_job(spec("runconfig.sparse_kernel=auto", "runconfig.max_steps=2")),
                    model_dir=str(tmp_path), device="cuda")
    assert set(summary["kernels"].values()) == {"dense"}
    assert not (tmp_path / CALIBRATION_FILE).exists()


def test_bf16_autocast_is_applied_and_masked_weights_stay_zero(tmp_path):
    summary = train(plan_job(spec("model.mixed_precision=true", "model.fp16_type=bfloat16")),
                    model_dir=str(tmp_path), device="cuda")
    assert summary["precision"].startswith("bf16 autocast")
    assert all(math.isfinite(loss) for _, loss in summary["train_losses"])
    state = load_checkpoint(checkpoint_path(tmp_path, 10))["model"]
    assert not bool(state[WEIGHT][~state[WEIGHT + "_mask"]].any())


def test_fp16_loss_scaling_is_checkpointed_and_a_resume_continues(tmp_path):
    fp16 = ("model.mixed_precision=true", "model.fp16_type=float16",
            "optimizer.loss_scaling_factor=dynamic", "optimizer.initial_loss_scale=1024")
    first = train(plan_job(spec(*fp16)), model_dir=str(tmp_path), device="cuda")
    assert first["precision"].startswith("fp16 autocast, dynamic loss scaling from 1024")
    scaler = load_checkpoint(checkpoint_path(tmp_path, 10))["grad_scaler"]
    assert scaler["scale"] > 0
    resumed = train(plan_job(spec(*fp16, "runconfig.max_steps=15")), model_dir=str(tmp_path), device="cuda")
    assert [step for step, _ in resumed["train_losses"]] == list(range(11, 16))


def test_resume_on_gpu_follows_the_uninterrupted_run(tmp_path):
    """Exact on CPU (test_runner_train); on CUDA within float tolerance, since cuBLAS may
    reduce in another order from one run to the next."""
    whole = train(plan_job(spec()), model_dir=str(tmp_path / "whole"), device="cuda")
    train(plan_job(spec("runconfig.max_steps=5")), model_dir=str(tmp_path / "split"), device="cuda")
    rest = train(plan_job(spec()), model_dir=str(tmp_path / "split"), device="cuda")
    assert [step for step, _ in rest["train_losses"]] == list(range(6, 11))
    for (_, ours), (_, theirs) in zip(rest["train_losses"], whole["train_losses"][5:]):
        assert ours == pytest.approx(theirs, rel=1e-3)
    assert rest["mask_hashes"] == whole["mask_hashes"]


def test_the_gpu_step_is_compiled_by_default_fused_and_follows_the_eager_run(tmp_path):
    """The optimizer is torch's fused AdamW on CUDA, and runconfig.torch_compile's default
    compiles the model there: the compiled run follows the eager one, masks kept."""
    from training.build import build_run

    run = build_run(plan_job(spec()), tmp_path / "built", 0, torch.device("cuda"))
    assert run.optimizer.defaults["fused"] is True and run.torch_compile is False
    eager = train(plan_job(spec()), model_dir=str(tmp_path / "eager"), device="cuda")
    compiled = train(plan_job(spec("runconfig.torch_compile=auto")), model_dir=str(tmp_path / "compiled"),
                     device="cuda")
    assert compiled["torch_compile"] is True and eager["torch_compile"] is False
    assert compiled["mask_hashes"][0] == eager["mask_hashes"][0]
    for (_, ours), (_, theirs) in zip(compiled["train_losses"], eager["train_losses"]):
        assert ours == pytest.approx(theirs, rel=2e-2)
    state = load_checkpoint(checkpoint_path(tmp_path / "compiled", 10))["model"]
    assert not bool(state[WEIGHT][~state[WEIGHT + "_mask"]].any())
