"""A sparse model, its algorithm and its optimizer are freed once dropped.

Torch keeps a tensor's hooks on its C++ side, where the garbage collector cannot follow them: a
gradient hook that held the algorithm (which holds the parameter) was a cycle no collection
freed, so every model built and dropped stayed in memory; the service, which plans every job on
a meta model, grew by one per job and its collections paused it for longer and longer.
"""

import gc
import weakref

import pytest
import torch

import sparsity
import sparsity.cstorch as cstorch
from sparsity_helpers import TinyNet, train_steps

ALGORITHMS = ["static", "gmp", "set", "rigl", "granet"]


def released(build) -> bool:
    """Whether what `build` returns is gone after it is dropped and garbage is collected."""
    refs = [weakref.ref(thing) for thing in build()]
    gc.collect()
    return all(ref() is None for ref in refs)


def trained(alg, optimizer_class, attach):
    """A TinyNet sparsified by `alg`, its optimizer attached by `attach`, after two steps."""
    model = TinyNet()
    model.apply(alg)
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    attach(optimizer)
    train_steps(model, optimizer, 2)
    return model, alg, optimizer


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_trained_sparse_model_is_freed_once_dropped(name):
    def build():
        options = {"static": {}, "granet": {"update": {"freq": 1, "start": 0, "stop": 4}}}.get(
            name, {"update": {"freq": 1}})
        alg = sparsity.get_algorithm_class(name)(sparsity=0.5, **options)
        return trained(alg, torch.optim.SGD, alg.apply)

    assert released(build)


def test_a_model_sparsified_on_the_meta_device_is_freed_once_dropped():
    def build():
        with torch.device("meta"):
            model = TinyNet()
        alg = sparsity.configure({"algorithm": "rigl", "sparsity": 0.5, "update": {"freq": 1},
                                  "init_method": lambda p, _s, _g: torch.empty(
                                      p.shape, dtype=torch.bool, device=p.device)})
        model.apply(alg)
        return model, alg

    assert released(build)


def test_a_model_trained_through_the_cstorch_api_is_freed_once_dropped():
    def build():
        alg = cstorch.sparse.Static(sparsity=0.3)
        return trained(alg, cstorch.optim.SGD, lambda optimizer: optimizer.apply(alg))

    assert released(build)
