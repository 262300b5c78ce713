"""Every tensor the sparsity engine and the fabric keep lives on its parameter's device.

The suite has no GPU, so the model is moved to ``meta`` after training a few steps on the CPU:
a tensor the algorithm (or a fabric layer) holds that did not follow the model is still on the
CPU, which on CUDA is the "found at least two devices, cuda:0 and cpu" crash at the next mask
update (issue 42: the ITOP union stayed on the CPU). ``meta`` also replaces every parameter
object, so a stale reference to the pre-move parameter is found too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import simulator
import sparsity

from sparsity_helpers import TinyNet, train_steps

UPDATE = {"freq": 2}
ALGORITHMS = {
    "static": lambda: sparsity.Static(sparsity=0.5),
    "gmp": lambda: sparsity.GMP(sparsity={"type": "linear", "init": 0.2, "slope": 0.1}, update=UPDATE),
    "set": lambda: sparsity.SET(sparsity=0.5, update=UPDATE, drop_fraction=0.3),
    "rigl": lambda: sparsity.RigL(sparsity=0.5, update=UPDATE, drop_fraction=0.3),
    "granet": lambda: sparsity.GraNet(sparsity=0.5, update={"freq": 2, "stop": 5}),
    "group": lambda: sparsity.Group({"fc1.*": sparsity.Static(sparsity=0.3),
                                     "fc2.*": sparsity.RigL(sparsity=0.5, update=UPDATE)}),
}


def kept_tensors(root: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor reachable from `root` through attributes, containers and
    modules, optimizers excepted (the user builds those for the moved parameters)."""
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("alg", root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.optim.Optimizer, torch.Generator, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield path, obj
        elif isinstance(obj, dict):
            stack += [(f"{path}[{key!r}]", value) for key, value in obj.items()]
            stack += [(f"{path}.key", key) for key in obj if isinstance(key, torch.Tensor)]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += [(f"{path}[{i}]", value) for i, value in enumerate(obj)]
        elif dataclasses.is_dataclass(obj) or isinstance(obj, nn.Module) or _ours(obj):
            stack += [(f"{path}.{name}", value) for name, value in vars(obj).items()]
            stack += [(f"{path}.{name}", getattr(obj, name)) for name in _properties(obj)]


def _ours(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] in {"sparsity", "simulator"} and hasattr(obj, "__dict__")


def _properties(obj: Any) -> list[str]:
    # SparseParam reads its parameter and mask through properties: what it hands out counts.
    return [name for name in ("param", "mask") if isinstance(getattr(type(obj), name, None), property)]


def off_device(root: Any, device: str) -> list[str]:
    return [f"{path} on {tensor.device}" for path, tensor in kept_tensors(root)
            if tensor.device.type != device]


def trained(make_alg, *, fabric: str | None = None) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model, alg = TinyNet(), make_alg()
    model.apply(alg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    alg.apply(optimizer)
    if fabric is not None:
        simulator.compile(model, algorithm=alg, kernel=fabric, tokens=16, optimizer=optimizer)
    train_steps(model, optimizer, 5)  # updates at steps 2 and 4
    return model, alg


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_what_an_algorithm_keeps_follows_the_model_to_its_device(name):
    model, alg = trained(ALGORITHMS[name])
    assert not off_device(alg, "cpu")
    model.to("meta")
    assert not off_device(alg, "meta")


@pytest.mark.parametrize("kernel", ["csr", "dense"])
def test_the_fabric_layers_and_the_algorithm_follow_a_compiled_model_to_its_device(kernel):
    model, alg = trained(ALGORITHMS["rigl"], fabric=kernel)
    model.to("meta")
    assert not off_device(alg, "meta")
    assert not off_device(model, "meta")
    assert {sp.module for sp in alg.sparse_params.values()} <= set(model.modules())


def test_a_restored_itop_union_is_the_algorithms_state_not_the_models():
    model, alg = trained(ALGORITHMS["set"])
    state = alg.state_dict()
    assert any(not torch.equal(u, m) for u, (_, _, m) in zip(state["stats"]["union"].values(),
                                                               alg.sparse_parameters()))
    fresh_model, fresh = TinyNet(), sparsity.SET(sparsity=0.5, update=UPDATE, drop_fraction=0.3)
    fresh_model.apply(fresh)
    fresh_model.load_state_dict(model.state_dict())
    fresh.load_state_dict(state)
    assert all(torch.equal(fresh.stats.union[k], v) for k, v in state["stats"]["union"].items())
    assert not any(key.endswith("_union") for key in model.state_dict())
