"""What makes the GPU step fast, checked where the suite runs, on a CPU (issue 42): the loop
reads no tensor on the host between log steps (on CUDA each read is a sync that stops the host
queuing ahead of the GPU). tests/training/test_gpu.py runs the loop on a GPU itself."""

from __future__ import annotations

import pytest
import torch

from csx_config import JobSpec
from training.plan import plan_job
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
        summary = loop.train(plan_job(JobSpec.from_yaml(SPEC, list(overrides))), model_dir=str(tmp_path))
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
    eager = loop.train(plan_job(JobSpec.from_yaml(spec)), model_dir=str(tmp_path / "eager"))
    assert not compiled  # "auto": not on a CPU
    traced = loop.train(plan_job(JobSpec.from_yaml(spec, ["runconfig.torch_compile=true"])),
                        model_dir=str(tmp_path / "compiled"))
    assert len(compiled) == 1
    assert traced["train_losses"] == eager["train_losses"]


def _tiny_model(*overrides: str):
    from training.build import build_sparse_model
    from training.plan import model_config

    spec = JobSpec.from_yaml("model: {preset: tiny, dropout_rate: 0.0, attention_dropout_rate: 0.0}\n",
                             list(overrides))
    return build_sparse_model(model_config(spec, 256, 32), spec.sparsity, seed=0)


class Calls(torch.overrides.TorchFunctionMode):
    """Counts torch calls by name (a GPU kernel launch apiece, or more)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("overrides", [(), ("model.use_projection_bias_in_attention=true",
                                            "model.attention_module=multiquery_attention",
                                            "model.extra_attention_params={num_kv_groups: 2}")],
                         ids=["plain", "biases-and-grouped-kv"])
def test_one_qkv_matmul_computes_the_three_projections_and_their_gradients(overrides):
    """A GPU run's attention takes q, k and v from one matmul of the stacked weights (fewer
    launches: nanoGPT's c_attn); the model and its three parameters per layer are the same."""
    model, _ = _tiny_model(*overrides)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for one_matmul in (False, True):
        model.use_one_qkv_matmul(one_matmul)
        model.zero_grad(set_to_none=True)
        with Calls() as calls:
            _, loss = model(tokens, tokens)
        loss.backward()
        results.append((float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}, calls.names))
    (separate, separate_grads, separate_calls), (one, one_grads, one_calls) = results
    layers = model.built.num_hidden_layers
    assert one_calls["linear"] == separate_calls["linear"] - 2 * layers
    assert one == pytest.approx(separate, abs=1e-6)
    for name, grad in separate_grads.items():
        assert torch.allclose(one_grads[name], grad, atol=1e-6), name


def test_a_watched_projection_is_called_as_its_own_layer():
    """A forward hook on a projection (the user's, or a library's) still fires: the layer then
    runs on its own, not inside the stacked matmul."""
    model, _ = _tiny_model()
    model.use_one_qkv_matmul()
    seen = []
    model.transformer_decoder.layers[0].self_attn.proj_k_dense_layer.register_forward_hook(
        lambda module, args, output: seen.append(output.shape))
    model(torch.zeros(1, 8, dtype=torch.long))
    assert seen == [torch.Size([1, 8, model.built.kv_heads * model.built.head_dim])]


def test_the_sparsity_hooks_mask_a_step_in_a_number_of_calls_that_does_not_grow_with_the_layers():
    """One batched multiply for the step's gradients (clipping rescaled them after backward's
    masking) and none for weights and optimizer state an AdamW step kept at zero, whatever the
    number of sparse matrices: on a GPU each op per matrix was a launch from Python, and the
    step is the host's launches. Counted in ATen ops (kernels) inside optimizer.step()."""
    import sparsity
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.names[str(func)] = self.names.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    def step_ops(layers: int) -> dict[str, int]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])
        algorithm = sparsity.Static(sparsity=0.8)
        model.apply(algorithm)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        algorithm.apply(optimizer)
        for _ in range(3):  # the last step's: optimizer state exists, nothing loaded since
            optimizer.zero_grad(set_to_none=True)
            model(torch.randn(4, 16)).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with Ops() as ops:
                optimizer.step()
        return ops.names

    few, many = step_ops(2), step_ops(6)
    assert many == few
    assert many["aten._foreach_mul_.List"] == 1 and "aten.mul_.Tensor" not in many
