"""The snippets of Cerebras' "Sparsifying models" guide and ``cstorch.sparse`` reference run as
written, with ``sparsity`` in place of ``cstorch.sparse`` and ``sparsity.optim`` in place of
``cstorch.optim``, and do what the docs say.

The docs call the algorithm ``sparsity``, which would shadow the module here; it is ``alg`` below.
One deliberate difference: the guide's ``Static(sparsity=0.3)`` zeroes 30% of *every* parameter,
while our classes take the default filter unless given ``param_filter`` (docs/design.md §2); both are
checked.
"""

from __future__ import annotations

import pytest
import torch

import sparsity
from sparsity import keep_count, topk_mask
from sparsity_helpers import TinyNet, train_steps


def masks_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name[: -len("_mask")]: buf.clone() for name, buf in model.named_buffers() if name.endswith("_mask")}


def zeros(tensor: torch.Tensor) -> int:
    return int((tensor == 0).sum())


# ------------------------------------------------------------------- "How to sparsify your model"
def test_static_30_percent_sparsifies_the_model_and_the_optimizer():
    model = TinyNet()
    # Initialize a sparsity algorithm with 30% sparsity; apply it to the model
    alg = sparsity.Static(sparsity=0.3)
    model.apply(alg)
    # Sparsifying optimizers: the optimizer gets the same algorithm
    optimizer = sparsity.optim.SGD(model.parameters(), lr=0.1)
    optimizer.apply(alg)

    # After model.apply the parameters are sparse already: 72 of fc1's 240 weights, 36 of fc2's 120
    assert sorted(masks_of(model)) == ["fc1.weight", "fc2.weight"]
    assert zeros(model.fc1.weight) == 72 and zeros(model.fc2.weight) == 36
    initial = masks_of(model)
    train_steps(model, optimizer, 3)
    for name, mask in masks_of(model).items():
        weight = model.get_parameter(name)
        assert torch.equal(mask, initial[name])  # static: the pattern never moves
        assert (weight[~mask] == 0).all() and (weight.grad[~mask] == 0).all()
    # biases, the embedding and the norm stay dense under our default filter
    assert zeros(model.fc1.bias) == zeros(model.embedding.weight) == zeros(model.norm.weight) == 0


def test_static_30_percent_of_every_parameter_as_the_guide_describes():
    model = TinyNet()
    alg = sparsity.Static(sparsity=0.3, param_filter="*")
    model.apply(alg)
    for name, param in model.named_parameters():  # weights, biases, the embedding, the norm
        assert zeros(param) >= param.numel() - keep_count(param.numel(), 0.3), name
        assert int(model.get_buffer(f"{name}_mask").sum()) == keep_count(param.numel(), 0.3), name


# ------------------------------------------------------------------------------ requires_dense
def test_requires_dense_excludes_a_parameter_and_an_optimizer_state():
    model = TinyNet()
    # "To exclude certain parameters from sparsity, set param.requires_dense = True"
    model.fc1.weight.requires_dense = True
    alg = sparsity.Static(sparsity=0.3)
    model.apply(alg)
    optimizer = sparsity.optim.Adam(model.parameters(), lr=1e-2)
    optimizer.apply(alg)
    assert sorted(masks_of(model)) == ["fc2.weight"]
    assert zeros(model.fc1.weight) == 0

    train_steps(model, optimizer, 1)  # Adam creates its state in its first step
    p, mask = model.fc2.weight, model.fc2.weight_mask
    # "To exempt certain state tensors from sparsification, designate them as requiring to be dense"
    optimizer.state[p]["exp_avg_sq"].requires_dense = True
    for name in ("exp_avg", "exp_avg_sq"):  # put something at the pruned positions of both
        optimizer.state[p][name].masked_fill_(~mask, 1.0)
    train_steps(model, optimizer, 1)
    assert (optimizer.state[p]["exp_avg"][~mask] == 0).all()  # masked as always
    assert (optimizer.state[p]["exp_avg_sq"][~mask] > 0).all()  # left alone: decayed, not zeroed
    assert (p[~mask] == 0).all()


# ---------------------------------------------------------------------------------- autoupdate
def test_autoupdate_false_leaves_masks_fixed_until_update_is_called():
    model = TinyNet()
    alg = sparsity.SET(sparsity=0.5, update={"freq": 1}, drop_fraction=0.5)
    model.apply(alg)
    optimizer = sparsity.optim.SGD(model.parameters(), lr=0.1)
    optimizer.apply(alg)
    # "This automatic update feature can be deactivated if necessary"
    alg.autoupdate = False
    initial = masks_of(model)
    train_steps(model, optimizer, 3)  # every step is an update step, yet nothing moves
    assert all(torch.equal(mask, initial[name]) for name, mask in masks_of(model).items())

    alg.update()  # by hand: step 3 is an update step
    for name, mask in masks_of(model).items():
        weight = model.get_parameter(name)
        assert not torch.equal(mask, initial[name])
        assert int(mask.sum()) == keep_count(mask.numel(), 0.5)
        assert (weight[~mask] == 0).all()  # dropped weights are zero at once
        assert (weight[mask & ~initial[name]] == 0).all()  # grown ones start at zero


# ------------------------------------------------------------------- composing algorithms: Group
def group_as_in_the_guide() -> sparsity.Group:
    return sparsity.Group({
        "fc1.*": sparsity.Static(sparsity=0.3),
        "fc2.*": sparsity.SET(sparsity=0.9, update={"freq": 1000}, drop_fraction=0.3),
    })


def group_built_with_add() -> sparsity.Group:
    # the cstorch.sparse.Group reference fills a group with add(filter, algorithm)
    group = sparsity.Group()
    group.add("fc1.*", sparsity.Static(sparsity=0.3))
    group.add("fc2.*", sparsity.SET(sparsity=0.9, update={"freq": 1000}, drop_fraction=0.3))
    return group


@pytest.mark.parametrize("make_group", [group_as_in_the_guide, group_built_with_add], ids=["dict", "add"])
def test_group_of_static_and_set(make_group):
    model = TinyNet()
    alg = make_group()
    model.apply(alg)
    optimizer = sparsity.optim.SGD(model.parameters(), lr=0.05)
    optimizer.apply(alg)

    # the globs take every fc1 parameter to Static at 30%, every fc2 parameter to SET at 90%
    levels = {"fc1.weight": 0.3, "fc1.bias": 0.3, "fc2.weight": 0.9, "fc2.bias": 0.9}
    initial = masks_of(model)
    assert sorted(initial) == sorted(levels)
    for name, level in levels.items():
        assert int(initial[name].sum()) == keep_count(initial[name].numel(), level), name
    train_steps(model, optimizer, 999)
    assert all(torch.equal(mask, initial[name]) for name, mask in masks_of(model).items())
    train_steps(model, optimizer, 1)  # step 1000: SET's first update, Static never moves
    after = masks_of(model)
    assert torch.equal(after["fc1.weight"], initial["fc1.weight"])
    assert not torch.equal(after["fc2.weight"], initial["fc2.weight"])
    assert int(after["fc2.weight"].sum()) == keep_count(120, 0.9)


def test_an_empty_group_must_be_filled_before_it_is_applied():
    with pytest.raises(ValueError, match=r"add\(filter, algorithm\)"):
        TinyNet().apply(sparsity.Group())


# ------------------------------------------------------------------- a custom dynamic algorithm
class MagnitudeSparsity(sparsity.DynamicSparsityAlgorithm):
    """A user's algorithm as the docs write one: subclass DynamicSparsityAlgorithm and compute
    the new mask in ``update_mask``; here, keep the largest |w|."""

    def __init__(self, sparsity=None, **kwargs):
        super().__init__(sparsity, **kwargs)
        self.calls: list[int] = []

    @torch.no_grad()
    def update_mask(self, p, mask, sparsity):
        self.calls.append(self.step)
        return topk_mask(p.abs().reshape(1, -1), keep_count(p.numel(), sparsity)).reshape(p.shape)


def test_custom_dynamic_algorithm_configured_by_name():
    alg = sparsity.configure({"algorithm": "MagnitudeSparsity", "sparsity": 0.5, "update": {"freq": 2}})
    assert isinstance(alg, MagnitudeSparsity)
    model = TinyNet()
    model.apply(alg)
    optimizer = sparsity.optim.SGD(model.parameters(), lr=0.1)
    optimizer.apply(alg)
    train_steps(model, optimizer, 5)
    assert alg.calls == [2, 2, 4, 4]  # once per sparse parameter, on update steps only
    for name, mask in masks_of(model).items():
        assert int(mask.sum()) == keep_count(mask.numel(), 0.5), name
    with pytest.raises(ValueError, match=r"'MagnitudeSparsityy'.*known:.*'magnitudesparsity'"):
        sparsity.configure({"algorithm": "MagnitudeSparsityy", "sparsity": 0.5})
