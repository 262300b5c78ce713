"""The training loop on the fabric's CSR layers with their weights as values (the optimizer
steps the non-zeros): a resume continues bit-identically, the collective carries the values'
gradients, and the run follows the masked dense one (same masks, losses within tolerance)."""

import shutil

import pytest
import torch

from csx_config import JobSpec
from training.checkpoint import load_checkpoint
from training.loop import train
from training.plan import plan_job

SPEC = """
train_input: {batch_size: 8, max_sequence_length: 32}
eval_input: {batch_size: 8, max_sequence_length: 32}
model: {preset: tiny}
optimizer: {optimizer_type: AdamW, learning_rate: 3.0e-3, weight_decay: 0.1}
sparsity: {algorithm: rigl, sparsity: 0.8, update: {freq: 3, stop: 7}, drop_fraction: 0.3}
runconfig: {max_steps: 8, checkpoint_steps: 4, eval_steps: 1, log_steps: 4, seed: 0, mlflow_experiment: "", sparse_kernel: csr}
"""


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_values_training_resumes_bit_identically_and_follows_masked_dense(tmp_path):
    spec = JobSpec.from_yaml(SPEC)
    straight = train(plan_job(spec), model_dir=str(tmp_path / "straight"), mode="train")
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    for name in ("checkpoint_4.mdl", "tokenizer.json"):
        shutil.copy(tmp_path / "straight" / name, resumed_dir)
    resumed = train(plan_job(spec), model_dir=str(resumed_dir), mode="train")
    assert resumed["train_losses"] == straight["train_losses"][4:]
    assert resumed["mask_hashes"] == straight["mask_hashes"]
    expected, got = (load_checkpoint(d / "checkpoint_8.mdl")
                     for d in (tmp_path / "straight", resumed_dir))
    assert expected["model"].keys() == got["model"].keys()
    for key, tensor in expected["model"].items():
        assert torch.equal(tensor, got["model"][key]), key
    for index, state in expected["optimizer"]["state"].items():
        for key, tensor in state.items():
            assert torch.equal(tensor, got["optimizer"]["state"][index][key]), (index, key)
    dense_spec = JobSpec.from_yaml(SPEC.replace("sparse_kernel: csr", "sparse_kernel: dense"))
    dense = train(plan_job(dense_spec), model_dir=str(tmp_path / "dense"), mode="train")
    dense_checkpoint = load_checkpoint(tmp_path / "dense" / "checkpoint_8.mdl")
    assert dense_checkpoint["model"].keys() == expected["model"].keys()
    for index, state in dense_checkpoint["optimizer"]["state"].items():
        assert {key: tensor.shape for key, tensor in state.items()} == {
            key: tensor.shape for key, tensor in expected["optimizer"]["state"][index].items()}
    assert dense["mask_hashes"] == straight["mask_hashes"]
    assert [loss for _, loss in straight["train_losses"]] == pytest.approx(
        [loss for _, loss in dense["train_losses"]], rel=1e-4)


def test_the_all_reduce_carries_the_values_gradients_on_ordinary_steps(tmp_path):
    shapes = []
    spec = JobSpec.from_yaml(SPEC.replace("max_steps: 8", "max_steps: 2"))
    train(plan_job(spec), model_dir=str(tmp_path), mode="train",
          all_reduce=lambda tensors: shapes.append([tuple(t.shape) for t in tensors]))
    first_step = shapes[0]
    assert (256, 64) in first_step  # the embedding's (dense) gradient
    # the sparse layers' gradients are their values (1-D), not dense matrices
    assert any(len(shape) == 1 and shape[0] % 64 == 0 and shape[0] > 256 for shape in first_step)
