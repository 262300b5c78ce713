"""Gradient and regrowth semantics shared with cstorch (issue 14, items 2 and 3).

Gradients are masked by a hook as backward produces them (NaN/inf at pruned positions become
0), so ``clip_grad_norm_`` between backward and step sees live weights only; RigL/GraNet read
the dense gradient captured by the same hook on update steps, summed over micro-batches. An
entry active before and after an update keeps its value and optimizer state; only entries grown
from inactive start at 0 (or as ``grow_init`` says).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import sparsity

ALGORITHMS = ["static", "gmp", "set", "rigl", "granet"]
OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
}


def build(shape, name, level, seed, update_freq=1):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(shape[1], shape[0]), nn.Tanh(), nn.Linear(shape[0], 3))
    kwargs = {"seed": seed}
    if name != "static":
        kwargs["update"] = {"freq": update_freq, "stop": 1000}
    if name == "granet":
        kwargs["init_sparsity"] = level / 2
    alg = sparsity.get_algorithm_class(name)(sparsity=level, **kwargs)
    model.apply(alg)
    return model, alg


def loss_of(model, shape, seed, batch=5):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, shape[1], generator=gen)
    return (model(x) ** 2).mean()


def poison_pruned_gradients(model, fill):
    """A user hook that writes NaN/inf into each weight gradient at its pruned positions (it runs
    on each contribution, before the sparsity hook sees the accumulated gradient)."""
    for module in model:
        if isinstance(module, nn.Linear):
            mask = module.weight_mask
            module.weight.register_hook(lambda g, m=mask: torch.where(m, g, torch.full_like(g, fill)))


@settings(max_examples=25)
@given(shape=st.tuples(st.integers(2, 16), st.integers(2, 16)), level=st.floats(0.1, 0.9),
       name=st.sampled_from(ALGORITHMS), micro_batches=st.integers(1, 3),
       fill=st.sampled_from([math.nan, math.inf, -math.inf]), seed=st.integers(0, 2**16))
def test_after_backward_every_pruned_gradient_is_exactly_zero(shape, level, name, micro_batches, fill, seed):
    model, alg = build(shape, name, level, seed)
    poison_pruned_gradients(model, fill)
    for index in range(micro_batches):
        loss_of(model, shape, seed + index).backward()
    for _, param, mask in alg.sparse_parameters():
        assert torch.equal(param.grad[~mask], torch.zeros_like(param.grad[~mask]))  # NaN fails
        assert bool(torch.isfinite(param.grad[mask]).all())


def reference_norm(model, alg, shape, seed):
    """The global gradient norm over live weights, from gradients autograd.grad computes (no
    accumulation, so no sparsity hook) with the masks applied by hand."""
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_of(model, shape, seed), params)
    masks = {id(p): m for _, p, m in alg.sparse_parameters()}
    live = [torch.where(masks[id(p)], g, 0.0) if id(p) in masks else g for p, g in zip(params, grads)]
    dense = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in live])), dense


@settings(max_examples=25)
@given(shape=st.tuples(st.integers(2, 16), st.integers(2, 16)), level=st.floats(0.3, 0.9),
       name=st.sampled_from(ALGORITHMS), seed=st.integers(0, 2**16))
def test_clip_grad_norm_returns_the_live_weights_norm(shape, level, name, seed):
    model, alg = build(shape, name, level, seed)
    expected, dense = reference_norm(model, alg, shape, seed)
    loss_of(model, shape, seed).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert torch.allclose(total, expected, rtol=1e-5, atol=1e-7)
    assert float(dense) >= float(total)


def test_a_nan_at_a_pruned_position_does_not_poison_the_clip():
    model, alg = build((8, 8), "static", 0.5, seed=3)
    expected, _ = reference_norm(model, alg, (8, 8), seed=3)
    poison_pruned_gradients(model, math.nan)
    loss_of(model, (8, 8), seed=3).backward()
    assert torch.allclose(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), expected)


@settings(max_examples=20)
@given(shape=st.tuples(st.integers(3, 16), st.integers(3, 16)), level=st.floats(0.2, 0.8),
       name=st.sampled_from(["set", "rigl", "granet"]), optimizer=st.sampled_from(sorted(OPTIMIZERS)),
       seed=st.integers(0, 2**16))
def test_entries_active_before_and_after_an_update_keep_value_and_moments(shape, level, name, optimizer, seed):
    model, alg = build(shape, name, level, seed)
    opt = OPTIMIZERS[optimizer](model.parameters())
    seen = {}

    def snapshot(optimizer, args, kwargs):  # registered before alg's hook: runs just before the update
        seen.update({n: (p.detach().clone(), m.clone(), {k: v.clone() for k, v in optimizer.state[p].items()
                                                           if torch.is_tensor(v) and v.shape == p.shape})
                     for n, p, m in alg.sparse_parameters()})

    opt.register_step_post_hook(snapshot)
    alg.apply(opt)
    for step in range(3):
        opt.zero_grad()
        loss_of(model, shape, seed + step).backward()
        opt.step()
        for n, p, new in alg.sparse_parameters():
            weight, old, states = seen[n]
            both, grown = old & new, new & ~old
            assert torch.equal(p.detach()[both], weight[both])
            assert not bool(p.detach()[~new].any()) and not bool(p.detach()[grown].any())
            for key, before in states.items():
                after = opt.state[p][key]
                assert torch.equal(after[both], before[both]), key
                assert not bool(after[grown].any()) and not bool(after[~new].any()), key


def hand_worked_rigl(**kwargs):
    """RigL on 4 weights, keeping 2: 1.0 and 0.75 live; the update drops 0.75 (smallest live)
    and grows by |grad| among the other three, including 0.75's own position."""
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0.25, 0.75, 0.5]]))
    alg = sparsity.RigL(sparsity=0.5, update=1, drop_fraction=0.5, param_filter="weight",
                        init_method="topk", **kwargs)
    model.apply(alg)
    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    alg.apply(opt)
    return model, alg, opt


def test_rigl_entry_dropped_and_regrown_in_one_update_keeps_value_and_momentum():
    model, alg, opt = hand_worked_rigl()
    model.weight.grad = torch.tensor([[0.5, 1.0, 9.0, 0.0]])
    opt.step()
    assert model.weight_mask.tolist() == [[True, False, True, False]]  # 0.75 dropped, grown back
    assert model.weight.tolist() == [[1.0, 0.0, 0.75, 0.0]]
    assert opt.state[model.weight]["momentum_buffer"].tolist() == [[0.5, 0.0, 9.0, 0.0]]


def test_rigl_entry_grown_from_inactive_starts_at_zero_with_zero_momentum():
    model, alg, opt = hand_worked_rigl()
    model.weight.grad = torch.tensor([[0.5, 9.0, 1.0, 0.0]])
    opt.step()
    assert model.weight_mask.tolist() == [[True, True, False, False]]
    assert model.weight.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert opt.state[model.weight]["momentum_buffer"].tolist() == [[0.5, 0.0, 0.0, 0.0]]


def test_rigl_dense_gradient_is_summed_over_micro_batches_and_captured_on_update_steps_only():
    shape = (6, 5)
    model, alg = build(shape, "rigl", 0.5, seed=1, update_freq=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    alg.apply(opt)
    params = [p for _, p, _ in alg.sparse_parameters()]
    for step in range(2):
        expected = [torch.zeros_like(p) for p in params]
        for micro in range(3):
            grads = torch.autograd.grad(loss_of(model, shape, 10 * step + micro), params)
            expected = [e + g for e, g in zip(expected, grads)]
            loss_of(model, shape, 10 * step + micro).backward()
        captured = alg.captured_dense_grads()
        if step == 0:  # step 1 is not an update step: nothing is captured
            assert captured == []
        else:
            assert len(captured) == len(expected)
            for got, want in zip(captured, expected):
                assert torch.allclose(got, want, atol=1e-6)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", ["set", "rigl", "granet"])
@pytest.mark.parametrize("grow_init", ["zeros", "random_normal", "initial_dist"])
def test_grow_init_through_constructor_and_configure(name, grow_init):
    extra = {"init_sparsity": 0.4} if name == "granet" else {}
    built = sparsity.get_algorithm_class(name)(sparsity=0.6, update={"freq": 1, "stop": 50},
                                               grow_init=grow_init, **extra)
    configured = sparsity.configure({"algorithm": name, "sparsity": 0.6, "update": {"freq": 1, "stop": 50},
                                     "grow_init": grow_init, **extra})
    assert built.grow_init == configured.grow_init == grow_init


def test_grow_init_rejects_unknown_values_by_name():
    with pytest.raises(ValueError, match="grow_init"):
        sparsity.RigL(sparsity=0.5, update=1, grow_init="ones")
    with pytest.raises(ValueError, match=r"sparsity: .*grow_init"):
        sparsity.configure({"algorithm": "set", "sparsity": 0.5, "update": 1, "grow_init": "uniform"})


def grown_values(grow_init, seed=0):
    torch.manual_seed(0)
    model = nn.Linear(30, 20, bias=False)
    initial = model.weight.detach().clone()
    alg = sparsity.SET(sparsity=0.7, update=1, drop_fraction=0.5, param_filter="weight",
                       grow_init=grow_init, seed=seed)
    model.apply(alg)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    alg.apply(opt)
    old = model.weight_mask.clone()
    kept = model.weight.detach()[old].clone()
    model.weight.grad = torch.zeros_like(model.weight)
    opt.step()
    grown = model.weight_mask & ~old
    assert int(grown.sum()) > 20
    return model.weight.detach()[grown], kept, initial


def test_grow_init_random_normal_draws_with_the_kept_weights_spread_deterministically():
    values, kept, _ = grown_values("random_normal")
    assert bool((values != 0).all())
    assert 0.5 < float(values.std()) / float(kept.std()) < 1.6
    assert torch.equal(values, grown_values("random_normal")[0])
    assert not torch.equal(values, grown_values("random_normal", seed=1)[0])


def test_grow_init_initial_dist_draws_from_the_initial_weights():
    values, _, initial = grown_values("initial_dist")
    pool = set(initial.reshape(-1).tolist())
    assert all(v in pool for v in values.tolist())
    assert len(set(values.tolist())) == values.numel()  # a shuffle: no value drawn twice


def test_grow_init_initial_dist_survives_a_state_dict_round_trip():
    torch.manual_seed(0)
    model = nn.Linear(8, 8, bias=False)
    alg = sparsity.RigL(sparsity=0.5, update=1, param_filter="weight", grow_init="initial_dist")
    model.apply(alg)
    state = alg.state_dict()
    fresh = sparsity.RigL(sparsity=0.5, update=1, param_filter="weight", grow_init="initial_dist")
    fresh.load_state_dict(state)
    assert torch.equal(fresh.state_dict()["initial_values"]["weight"], state["initial_values"]["weight"])


def test_data_parallel_replicas_grow_from_the_all_reduced_dense_gradient():
    """As training/loop.py does it: each replica backpropagates its half of the batch, the
    gradients and the captured dense gradients are averaged in one collective, then each steps.
    Every replica must end with the masks of one process stepping on the whole batch."""
    shape = (10, 8)

    def replica():
        model, alg = build(shape, "rigl", 0.7, seed=5)
        model.double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        alg.apply(opt)
        return model, alg, opt

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, shape[1], generator=gen, dtype=torch.float64) for _ in range(3)]
    single, replicas = replica(), [replica(), replica()]
    for x in batches:
        model, alg, opt = single
        (model(x) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        for (model, _, _), half in zip(replicas, x.chunk(2)):
            (model(half) ** 2).mean().backward()
        tensors = [[p.grad for p in model.parameters()] + alg.captured_dense_grads()
                   for model, alg, _ in replicas]
        assert len(tensors[0]) == 4 + 2  # update step: the two weights' dense gradients travel too
        for pair in zip(*tensors):
            mean = (pair[0] + pair[1]) / 2
            for tensor in pair:
                tensor.copy_(mean)
        for _, _, opt in replicas:
            opt.step()
            opt.zero_grad()
    expected = [mask for _, _, mask in single[1].sparse_parameters()]
    for _, alg, _ in replicas:
        assert all(torch.equal(a, b) for a, b in zip(expected, [m for _, _, m in alg.sparse_parameters()]))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS) + ["lbfgs-like"])
def test_weights_written_between_steps_are_masked_again_by_the_next_step(optimizer):
    """The step hooks skip the masking pass when a step can only write zeros at masked positions;
    a weight written by hand in between, or an optimizer they do not know, is masked anyway."""
    model, alg = build((6, 5), "static", 0.5, seed=2)
    if optimizer == "lbfgs-like":
        class Scatter(torch.optim.SGD):  # overrides step(): not trusted to keep zeros
            def step(self, closure=None):
                for group in self.param_groups:
                    for p in group["params"]:
                        p.data.add_(1.0)

        opt = Scatter(model.parameters(), lr=0.1)
    else:
        opt = OPTIMIZERS[optimizer](model.parameters())
    alg.apply(opt)
    for step in range(3):
        loss_of(model, (6, 5), step).backward()
        if step == 1:
            with torch.no_grad():
                for _, param, mask in alg.sparse_parameters():
                    param[~mask] = 7.0
        opt.step()
        opt.zero_grad()
        for _, param, mask in alg.sparse_parameters():
            assert not bool(param.detach()[~mask].any()), (optimizer, step)
            for value in opt.state[param].values():
                if torch.is_tensor(value) and value.shape == param.shape:
                    assert not bool(value[~mask].any()), (optimizer, step)
