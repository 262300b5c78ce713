"""One test per cstorch 2.10 bug listed in docs/design.md §2; each fails on the reference behaviour."""

import math

import pytest
import torch

import sparsity
from sparsity.schedules import make_schedule
from sparsity_helpers import TinyNet, train_steps


def make(alg_cls=sparsity.SET, **kwargs):
    model = TinyNet()
    alg = alg_cls(**kwargs)
    model.apply(alg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    alg.apply(opt)
    return model, alg, opt


def test_bug1_drop_counts_follow_the_schedule_exactly():
    class Recorder(sparsity.SET):
        def update_mask(self, p, mask, level):
            self.fractions = getattr(self, "fractions", []) + [self.drop_fraction(self.step)]
            return super().update_mask(p, mask, level)

    model, alg, opt = make(Recorder, sparsity=0.5, update=1,
                           drop_fraction={"type": "cosine", "init": 0.4, "half_period": 4}, param_filter="fc1.weight")
    train_steps(model, opt, 4)
    assert alg.fractions == pytest.approx([0.4 * 0.5 * (1 + math.cos(math.pi * t / 4)) for t in (1, 2, 3, 4)])


def test_bug2_load_state_dict_restores_everything_and_keeps_input():
    model, alg, opt = make(sparsity.RigL, sparsity=0.6, update=2, seed=5)
    train_steps(model, opt, 5)
    state = alg.state_dict()
    snapshot = {k: (v.copy() if isinstance(v, dict) else v) for k, v in state.items()}
    fresh = sparsity.RigL(sparsity=0.6, update=2, seed=0)
    fresh.load_state_dict(state)
    assert state.keys() == snapshot.keys() and state["step"] == snapshot["step"]
    assert fresh.step == 5 and fresh.seed == 5
    restored = fresh.state_dict()
    union = state["stats"]["union"]
    assert all(torch.equal(restored["stats"]["union"][k], union[k]) for k in union)
    assert restored["stats"]["last"] == state["stats"]["last"] and restored["targets"] == state["targets"]


def test_bug3_unknown_names_and_callable_cadence_are_handled():
    with pytest.raises(ValueError, match="known"):
        sparsity.get_algorithm_class("nope")
    with pytest.raises(ValueError, match="known"):
        sparsity.SET(sparsity={"type": "nope"}, update=1)
    model, alg, opt = make(sparsity=0.5, update=lambda t: t == 2)
    train_steps(model, opt, 3)
    assert alg.is_update_step(2) and not alg.is_update_step(3)


def test_bug4_plain_function_schedule():
    model, alg, opt = make(sparsity.GMP, sparsity=lambda t: min(0.1 * t, 0.5), update=1)
    train_steps(model, opt, 3)
    assert alg.metrics()["sparsity/fc1.weight/actual"] == pytest.approx(0.3, abs=0.005)


def test_bug5_rising_target_is_reached_exactly_by_set_and_rigl():
    for cls in (sparsity.SET, sparsity.RigL):
        model, alg, opt = make(cls, sparsity={"type": "linear", "init": 0.5, "slope": 0.1}, update=1, drop_fraction=0.1)
        for _ in range(3):
            train_steps(model, opt, 1)
            target = 0.5 + 0.1 * alg.step
            assert int(model.fc1.weight_mask.sum()) == sparsity.keep_count(240, target)


def test_bug6_active_zero_is_dropped_before_any_pruned_zero(monkeypatch):
    import sparsity.algorithms.set as set_module

    survivors = []
    real_drop = set_module.drop_minimum
    monkeypatch.setattr(set_module, "drop_minimum", lambda *a: survivors.append(real_drop(*a)) or survivors[-1])
    model, alg, opt = make(sparsity=0.5, update=1, drop_fraction=0.1, param_filter="fc1.weight")
    with torch.no_grad():
        active = model.fc1.weight_mask.nonzero()[:3].tolist()
        for r, c in active:
            model.fc1.weight[r, c] = 0.0  # three active zeros: the smallest |w| among active
    alg.step = 1
    alg.update()
    kept = survivors[0].reshape(model.fc1.weight.shape)
    assert int(kept.sum()) == 120 - 12  # floor(0.1 * 120) dropped, all of them active
    assert not any(kept[r, c] for r, c in active)


def test_bug7_masks_only_computed_on_update_steps_and_no_global_rng_use():
    class Counting(sparsity.SET):
        calls = 0

        def update_mask(self, p, mask, level):
            Counting.calls += 1
            return super().update_mask(p, mask, level)

    model, alg, opt = make(Counting, sparsity=0.5, update=3)
    rng = torch.random.get_rng_state()
    train_steps(model, opt, 5)  # steps 1..5: one update at step 3, two parameters
    assert Counting.calls == 2
    assert torch.equal(rng, torch.random.get_rng_state())


def test_bug8_static_masks_exist_right_after_apply():
    model = TinyNet()
    model.apply(sparsity.Static(sparsity=0.5))
    assert int((model.fc1.weight == 0).sum()) == 120


def test_bug9_plain_torch_optimizers_and_several_of_them():
    for opt_cls in (torch.optim.Adadelta, torch.optim.NAdam, torch.optim.Rprop, torch.optim.ASGD):
        model = TinyNet()
        alg = sparsity.RigL(sparsity=0.5, update=1)
        model.apply(alg)
        opt = opt_cls(model.parameters())
        alg.apply(opt)
        train_steps(model, opt, 2)
        assert alg.step == 2 and (model.fc1.weight[~model.fc1.weight_mask] == 0).all()


def test_bug10_exact_counts():
    model = torch.nn.Linear(32, 20)  # 640 weights
    model.apply(sparsity.Static(sparsity=0.8))
    assert int(model.weight_mask.sum()) == 128
