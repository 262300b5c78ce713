"""Weights as values at the layer level (``simulator.compile(..., optimizer=)``): training with
the optimizer stepping the CSR layers' non-zeros equals training on their dense weights (the
same checkpoints, bit for bit) and masked dense training (losses within float tolerance, the
same masks), through mask updates and a resume."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import simulator
import sparsity
from simulator.csr import padded_length

SPARSE = ["0.weight", "2.weight"]
ALGORITHMS = {
    "static": lambda: sparsity.Static(sparsity=0.8, param_filter=SPARSE, seed=0),
    "rigl": lambda: sparsity.RigL(sparsity=0.8, update={"freq": 3}, drop_fraction=0.3,
                                  param_filter=SPARSE, seed=0),
    "set": lambda: sparsity.SET(sparsity=0.8, update={"freq": 3}, drop_fraction=0.3,
                                param_filter=SPARSE, seed=0),
    "granet": lambda: sparsity.GraNet(sparsity=0.85, init_sparsity=0.5,
                                      update={"freq": 3, "start": 3, "stop": 30},
                                      drop_fraction=0.3, param_filter=SPARSE, seed=0),
}


class Training:
    """A small MLP under a sparsity algorithm and fused AdamW: masked dense (`mode` "dense"),
    on CSR layers computing on the dense weights ("csr") or with the weights as values
    ("values")."""

    def __init__(self, mode: str, algorithm: str, width: int, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(24, width), nn.ReLU(), nn.Linear(width, 16),
                                   nn.ReLU(), nn.Linear(16, 4))
        self.algorithm = ALGORITHMS[algorithm]()
        self.algorithm.apply(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1,
                                           fused=True)
        self.algorithm.apply(self.optimizer)
        if mode != "dense":
            simulator.compile(self.model, self.algorithm, kernel="csr",
                              optimizer=self.optimizer if mode == "values" else None)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def checkpoint(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "sparsity": self.algorithm.state_dict()}

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.algorithm.load_state_dict(state["sparsity"])


def batches(count: int, tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(tokens, 24, generator=generator),
             torch.randn(tokens, 4, generator=generator)) for _ in range(count)]


def saved(state: dict) -> dict:
    """`state` through torch.save and torch.load, as a checkpoint file holds it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def assert_bit_identical(got: dict, expected: dict) -> None:
    assert list(got["model"]) == list(expected["model"])
    for key, tensor in expected["model"].items():
        assert torch.equal(got["model"][key], tensor), key
    assert got["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    assert got["optimizer"]["state"].keys() == expected["optimizer"]["state"].keys()
    for index, state in expected["optimizer"]["state"].items():
        for key, tensor in state.items():
            assert torch.equal(got["optimizer"]["state"][index][key], tensor), (index, key)
    assert same_data(got["sparsity"], expected["sparsity"])


def same_data(a, b) -> bool:
    """Equal nested dicts/lists of plain values and tensors (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(same_data(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same_data(x, y) for x, y in zip(a, b)))
    return a == b


@settings(max_examples=8)
@given(algorithm=st.sampled_from(sorted(ALGORITHMS)), width=st.integers(8, 72),
       tokens=st.integers(1, 96), threads=st.integers(1, 4), steps=st.integers(4, 8),
       seed=st.integers(0, 2**16))
def test_values_training_equals_dense_weight_and_masked_dense_training(
        algorithm, width, tokens, threads, steps, seed):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = {mode: Training(mode, algorithm, width, seed) for mode in ("dense", "csr", "values")}
        for x, y in batches(steps, tokens, seed):
            losses = {mode: run.step(x, y) for mode, run in runs.items()}
            assert losses["values"] == losses["csr"]
            assert losses["values"] == pytest.approx(losses["dense"], rel=1e-4, abs=1e-6)
            for (name, _, mask), (_, _, dense_mask) in zip(
                    runs["values"].algorithm.sparse_parameters(),
                    runs["dense"].algorithm.sparse_parameters()):
                assert torch.equal(mask, dense_mask), name
        assert_bit_identical(runs["values"].checkpoint(), runs["csr"].checkpoint())
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("algorithm", ["rigl", "granet"])
def test_a_resume_of_values_training_continues_bit_identically(algorithm):
    """Checkpoint mid-period (values live) and load it into a model and optimizer trained
    elsewhere (their values live too): the same steps as the run that went on, through an
    update step, and its checkpoints."""
    data = batches(10, 40, seed=3)
    straight = Training("values", algorithm, 32, seed=3)
    for x, y in data[:4]:
        straight.step(x, y)
    checkpoint = saved(straight.checkpoint())
    assert_bit_identical(checkpoint, saved(_trained("csr", algorithm, data[:4]).checkpoint()))
    resumed = Training("values", algorithm, 32, seed=99)
    for x, y in data[8:]:  # other weights, live as values, when the checkpoint loads
        resumed.step(x, y)
    assert resumed.model[0].values is not None
    resumed.load(checkpoint)
    for x, y in data[4:]:
        assert resumed.step(x, y) == straight.step(x, y)
    assert_bit_identical(saved(resumed.checkpoint()), saved(straight.checkpoint()))


def _trained(mode: str, algorithm: str, data) -> Training:
    run = Training(mode, algorithm, 32, seed=3)
    for x, y in data:
        run.step(x, y)
    return run


def test_ordinary_steps_step_the_values_and_update_steps_the_dense_weight():
    run = Training("values", "rigl", 32, seed=0)
    layer, optimizer = run.model[0], run.optimizer
    stepped = lambda: {id(p) for group in optimizer.param_groups for p in group["params"]}
    data = batches(4, 16, seed=0)
    run.step(*data[0])  # step 1: ordinary
    nnz = int(layer.weight_mask.sum())
    assert layer.values is not None and layer.values.shape == (padded_length(nnz),)
    assert id(layer.values) in stepped() and id(layer.weight) not in stepped()
    assert layer.weight.grad is None  # no dense weight gradient
    state = optimizer.state[layer.values]
    assert state["exp_avg"].shape == (padded_length(nnz),)  # the state at the non-zeros only
    assert torch.equal(layer.values[nnz:], torch.zeros(padded_length(nnz) - nnz))
    run.step(*data[1])
    run.step(*data[2])  # step 3 updates the masks: it runs on the dense weight
    assert layer.values is None and id(layer.weight) in stepped()
    assert layer.weight.grad is not None and layer.weight.grad.shape == layer.weight.shape
    run.step(*data[3])  # step 4: the values again, of the new mask
    nnz = int(layer.weight_mask.sum())
    assert layer.values.shape == (padded_length(nnz),) and id(layer.values) in stepped()
    assert layer.weight.grad is None


def test_compile_rejects_an_optimizer_that_is_none_or_an_algorithm_without_a_schedule():
    model = nn.Sequential(nn.Linear(4, 4))
    sparsity.Static(sparsity=0.5).apply(model)
    with pytest.raises(TypeError, match="optimizer"):
        simulator.compile(model, optimizer=object())

    class GradientOnly:
        def needs_dense_grad(self) -> bool:
            return False

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="is_update_step"):
        simulator.compile(model, GradientOnly(), optimizer=optimizer)
