"""What makes the GPU step fast, checked where the suite runs, on a CPU (issue 42): the loop
reads no tensor on the host between log steps (on CUDA each read is a sync that stops the host
queuing ahead of the GPU). tests/training/test_gpu.py runs the loop on a GPU itself."""

from __future__ import annotations

import pytest
import torch

from csx_config import JobSpec
from training import loop
from training.host_reads import HostReads

SPEC = """
train_input: {batch_size: 4, max_sequence_length: 16}
model: {preset: tiny, dropout_rate: 0.1}
optimizer: {optimizer_type: AdamW, learning_rate: 1.0e-3, max_gradient_norm: 1.0}
runconfig: {max_steps: 12, log_steps: 6, seed: 0, mlflow_experiment: "", sparse_kernel: dense}
"""
RIGL = "sparsity={algorithm: rigl, sparsity: 0.8, update: {freq: 4, stop: 9}}"


def reads_by_step(monkeypatch, tmp_path, *overrides: str) -> tuple[dict[int, list[str]], dict]:
    """Each host read of a training run, by the optimizer step whose code made it (0: setup)."""
    steps_begun = [0]
    step = loop._optimizer_step

    def counted_step(run, all_reduce):
        steps_begun[0] += 1
        return step(run, all_reduce)

    monkeypatch.setattr(loop, "_optimizer_step", counted_step)
    by_step: dict[int, list[str]] = {}

    class ByStep(HostReads):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            before = len(self.names)
            result = super().__torch_function__(func, types, args, kwargs)
            if len(self.names) > before:
                by_step.setdefault(steps_begun[0], []).append(self.names[-1])
            return result

    with ByStep():
        summary = loop.train(JobSpec.from_yaml(SPEC, list(overrides)), model_dir=str(tmp_path))
    return by_step, summary


def test_a_dense_run_reads_one_tensor_per_log_step_and_none_between(monkeypatch, tmp_path):
    by_step, summary = reads_by_step(monkeypatch, tmp_path)
    assert {step: names for step, names in by_step.items() if step} == {6: ["tolist"], 12: ["tolist"]}
    # every step's loss still reaches the summary, in order, as a float
    assert [step for step, _ in summary["train_losses"]] == list(range(1, 13))
    assert all(type(value) is float for _, value in summary["train_losses"])


def test_a_sparse_run_reads_only_on_log_steps_and_around_mask_updates(monkeypatch, tmp_path):
    """Updates at steps 4 and 8 read (scores, counts, mask hashes), and so does the next
    forward, where the CPU fabric re-reads the changed masks; steps between read nothing."""
    by_step, _ = reads_by_step(monkeypatch, tmp_path, RIGL)
    assert set(by_step) - {0} == {4, 5, 6, 8, 9, 12}


class OnDevice:
    """A parameter as fused_kernel sees it, on a device this machine may not have."""

    def __init__(self, device: str, floating: bool = True) -> None:
        self.device, self.floating = torch.device(device), floating

    def is_floating_point(self) -> bool:
        return self.floating


@pytest.mark.parametrize("cls, device, loss_scaled, fused", [
    (torch.optim.AdamW, "cuda", False, True),  # nanoGPT's AdamW(fused=True) on CUDA
    (torch.optim.Adam, "cuda", False, True),
    (torch.optim.SGD, "cuda", False, True),
    (torch.optim.Adagrad, "cuda", False, False),  # its fused kernel is the CPU's alone
    (torch.optim.AdamW, "cuda", True, False),  # GradScaler would step it on skipped steps
    (torch.optim.AdamW, "cpu", False, True),
    (torch.optim.Adagrad, "cpu", False, True),
    (torch.optim.AdamW, "meta", False, False),
])
def test_the_optimizer_is_fused_where_torch_has_a_kernel_for_the_device(cls, device, loss_scaled, fused):
    from training.build import fused_kernel

    assert fused_kernel(cls, [OnDevice(device), OnDevice(device)], loss_scaled) is fused
    assert fused_kernel(cls, [OnDevice(device), OnDevice("cpu" if device != "cpu" else "cuda")],
                        loss_scaled) is False  # one kernel steps one device's tensors
    assert fused_kernel(cls, [OnDevice(device, floating=False)], loss_scaled) is False


def test_torch_compile_is_on_by_default_on_cuda_where_no_fabric_layer_runs():
    from training.build import compiles, fabric_layers

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not fabric_layers(True, "auto", cuda) and not fabric_layers(True, "dense", cuda)
    assert fabric_layers(True, "csr", cuda) and fabric_layers(True, "dense", cpu)
    assert not fabric_layers(False, "auto", cpu)
    assert compiles("auto", cuda, fabric=False) and not compiles("auto", cpu, fabric=False)
    assert not compiles("auto", cuda, fabric=True) and not compiles(False, cuda, fabric=False)
    assert compiles(True, cpu, fabric=False)
    with pytest.raises(ValueError, match="runconfig.torch_compile"):
        compiles(True, cuda, fabric=True)


def test_a_run_with_torch_compile_traces_the_model_as_one_graph_and_trains_alike(monkeypatch, tmp_path):
    """torch.compile's graph capture (the `eager` backend: no code generation, so a CPU test
    stays quick) of the model as the loop builds it, dropout and all, without a graph break
    (fullgraph), and the same losses as without it."""
    compile_module = torch.nn.Module.compile
    compiled: list[torch.nn.Module] = []

    def capture_only(module, **options):
        compiled.append(module)
        compile_module(module, backend="eager", fullgraph=True, **options)

    monkeypatch.setattr(torch.nn.Module, "compile", capture_only)
    spec = SPEC.replace("max_steps: 12", "max_steps: 4")
    eager = loop.train(JobSpec.from_yaml(spec), model_dir=str(tmp_path / "eager"))
    assert not compiled  # "auto": not on a CPU
    traced = loop.train(JobSpec.from_yaml(spec, ["runconfig.torch_compile=true"]),
                        model_dir=str(tmp_path / "compiled"))
    assert len(compiled) == 1
    assert traced["train_losses"] == eager["train_losses"]


def test_a_cpu_run_leaves_the_cuda_backends_float32_matmuls_alone(tmp_path):
    from training.precision import resolve_precision

    summary = loop.train(JobSpec.from_yaml(SPEC, ["runconfig.max_steps=1"]), model_dir=str(tmp_path))
    assert summary["precision"] == "float32"
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert resolve_precision({}, {}, torch.device("cuda")).applied == "float32 (TF32 matmuls)"
