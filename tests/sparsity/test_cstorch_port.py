"""cstorch code ports by changing one import (issue 14, items 1 and 4-7 and the porting module):
each test writes the code as the cstorch guide / sparsity blog write it, with ``cstorch.sparse``
→ ``sparsity`` (or ``import sparsity.cstorch as cstorch``)."""

from __future__ import annotations

import copy
import math
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparsity
import sparsity.cstorch as cstorch
from sparsity import schedules
from sparsity_helpers import TinyNet, train_steps


def masks_of(model):
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith("_mask")}


# ------------------------------------------------------------ 1. the guide's custom algorithm
class KeepLargest(sparsity.SparsityAlgorithm):
    """The guide's pattern: override update(), loop over self.sparse_params, read .data and
    .mask, assign a new mask. Keeps the largest |w| at the scheduled level every 2 steps."""

    @torch.no_grad()
    def update(self, optimizer=None):
        if self.step % 2:
            return
        for sparse_param in self.sparse_params.values():
            level = self.sparsity[sparse_param.param](self.step)
            keep = sparsity.keep_count(sparse_param.data.numel(), level)
            score = torch.where(sparse_param.mask, sparse_param.data.abs(), -1.0)
            sparse_param.mask = sparsity.topk_mask(score.reshape(1, -1), keep).reshape(score.shape)


def test_the_guides_custom_algorithm_runs_and_keeps_exact_counts():
    model = TinyNet()
    alg = KeepLargest(sparsity={"type": "linear", "init": 0.2, "slope": 0.1})
    model.apply(alg)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.apply(alg)
    assert sorted(alg.sparse_params) == ["fc1.weight", "fc2.weight"]
    train_steps(model, optimizer, 4)
    for name, sparse_param in alg.sparse_params.items():
        assert sparse_param.data.data_ptr() == model.get_parameter(name).data_ptr()
        assert int(sparse_param.mask.sum()) == sparsity.keep_count(sparse_param.mask.numel(), 0.2 + 0.1 * 4)
        assert not bool(sparse_param.data[~sparse_param.mask].any())  # re-masked after the update
    assert sparsity.get_algorithm_class("keeplargest") is KeepLargest


def test_assigning_a_mask_of_the_wrong_shape_names_the_parameter():
    model = TinyNet()
    alg = sparsity.Static(sparsity=0.5)
    model.apply(alg)
    with pytest.raises(ValueError, match="fc1.weight"):
        alg.sparse_params["fc1.weight"].mask = torch.ones(3, dtype=torch.bool)


def test_a_group_lists_its_members_sparse_params():
    model = TinyNet()
    group = sparsity.Group({"fc1.*": sparsity.Static(sparsity=0.3), "fc2.weight": sparsity.GMP(sparsity=0.5, update=1)})
    model.apply(group)
    assert sorted(group.sparse_params) == ["fc1.bias", "fc1.weight", "fc2.weight"]


# ---------------------------------------------------------- 4. configure_sparsity_wrapper
@settings(max_examples=6)
@given(name=st.sampled_from(["static", "gmp", "set", "rigl", "granet"]), before=st.integers(1, 5),
       after=st.integers(1, 5))
def test_a_wrapper_checkpoint_resumes_bit_identically(name, before, after):
    config = {"algorithm": name, "sparsity": 0.7, "seed": 3}
    if name != "static":
        config["update"] = {"freq": 2, "stop": 40}
    if name == "granet":
        config["init_sparsity"] = 0.3

    def fresh():
        torch.manual_seed(0)
        model = TinyNet()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, sparsity.configure_sparsity_wrapper(model, inner, config)

    model, optimizer = fresh()
    train_steps(model, optimizer, before, seed=1)
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    train_steps(model, optimizer, after, seed=2)

    resumed, resumed_optimizer = fresh()
    resumed.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    assert resumed_optimizer.algorithm.step == before
    train_steps(resumed, resumed_optimizer, after, seed=2)
    for (key, ours), (_, theirs) in zip(resumed.state_dict().items(), model.state_dict().items()):
        assert torch.equal(ours, theirs), key


def test_a_plain_optimizer_state_dict_is_refused_with_what_to_do():
    model = TinyNet()
    wrapper = sparsity.configure_sparsity_wrapper(model, torch.optim.SGD(model.parameters(), lr=0.1), 0.5)
    with pytest.raises(ValueError, match="wrapper.optimizer"):
        wrapper.load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1).state_dict())


def test_an_lr_scheduler_and_clipping_work_on_the_wrapper():
    model = TinyNet()
    optimizer = sparsity.configure_sparsity_wrapper(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                                    {"algorithm": "set", "sparsity": 0.5, "update": 1})
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(4, 12)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    assert optimizer.optimizer.param_groups[0]["lr"] == 0.25 and optimizer.algorithm.step == 2


# ------------------------------------------------------------------------- 5. schedules
class Constant(sparsity.BaseHyperParameter):
    """The blog's constant: the protocol on tensors."""

    TYPE = "blog_constant"

    def __init__(self, value):
        self.value = torch.tensor(value)

    def __call__(self, step: torch.Tensor, is_update_step: torch.Tensor) -> torch.Tensor:
        return self.value


class UpdateCounter(sparsity.BaseHyperParameter):
    """Reads is_update_step: 0.1 more at each update step seen."""

    TYPE = "update_counter"

    def __init__(self):
        self.updates = 0

    def __call__(self, step, is_update_step):
        self.updates += int(is_update_step)
        return torch.tensor(0.1 * self.updates)


def test_blog_hyperparameters_drop_in_as_instances_and_by_type():
    model = TinyNet()
    alg = sparsity.GMP(sparsity=Constant(0.6), update={"freq": 1, "stop": 5})
    model.apply(alg)
    assert int(model.fc1.weight_mask.sum()) == sparsity.keep_count(240, 0.6)
    configured = sparsity.configure({"algorithm": "set", "sparsity": {"type": "blog_constant", "value": 0.4},
                                     "update": 1, "drop_fraction": 0.2})
    assert configured.target_sparsity(7) == pytest.approx(0.4)
    assert Constant(0.25).get_min_max_end(0, 10) == (0.25, 0.25, 0.25)


def test_is_update_step_reaches_the_hyperparameter():
    model = TinyNet()
    alg = sparsity.GMP(sparsity=UpdateCounter(), update={"freq": 2, "stop": 9})
    model.apply(alg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    alg.apply(optimizer)
    train_steps(model, optimizer, 4)  # updates at steps 2 and 4
    assert int(model.fc1.weight_mask.sum()) == sparsity.keep_count(240, 0.2)


def test_cubic_counts_pruning_periods_as_the_blog_does():
    cubic = schedules.Cubic(init_sparsity=0.5, end_sparsity=0.8, sparsity_start_step=150,
                            sparsity_end_step=1150, prune_every_k_steps=100)
    assert cubic(200, True) == pytest.approx(0.5813, abs=1e-4)
    assert cubic(150) == 0.5 and cubic(1150) == pytest.approx(0.8) and cubic(5000) == pytest.approx(0.8)
    assert cubic.get_min_max_end(0, 1200) == (0.5, pytest.approx(0.8), pytest.approx(0.8))


def test_periodic_repeats_a_schedule():
    periodic = schedules.make_schedule({"type": "periodic", "period": 4,
                                        "schedule": {"type": "linear", "init": 0.1, "slope": 0.1}})
    assert [round(periodic(t), 6) for t in range(6)] == [0.1, 0.2, 0.3, 0.4, 0.1, 0.2]
    with pytest.raises(ValueError, match="period"):
        schedules.make_schedule({"type": "periodic", "period": 0, "schedule": 0.5})


def test_a_user_schedule_named_like_a_built_in_does_not_replace_it():
    with pytest.warns(UserWarning, match="'cubic' is built in"):
        class Cubic(sparsity.BaseHyperParameter):  # the blog's class name
            def __call__(self, step, is_update_step):
                return torch.tensor(0.0)
    assert schedules.Schedule.registry["cubic"] is schedules.Cubic
    assert sparsity.GMP(sparsity=Cubic(), update=1).target_sparsity(3) == 0.0


# --------------------------------------------------------------------------- 6. names
def test_score_shaper_and_tie_breaker_are_exported_and_taken_by_the_constructors():
    assert issubclass(sparsity.OutputGroupScoreShaper, sparsity.ScoreShaper)
    assert issubclass(sparsity.FirstTieBreaker, sparsity.ScoreTieBreaker)
    model = torch.nn.Linear(8, 4, bias=False)
    alg = sparsity.RigL(sparsity=0.5, update=1, param_filter="weight",
                        score_shaper=sparsity.OutputGroupScoreShaper(4), tie_breaker=sparsity.FirstTieBreaker())
    model.apply(alg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    alg.apply(optimizer)
    model.weight.grad = torch.randn(4, 8)
    optimizer.step()
    assert model.weight_mask.sum(dim=1).tolist() == [4, 4, 4, 4]  # balanced per output row
    assert isinstance(alg.tie_breaker(model.weight), sparsity.FirstTieBreaker)
    with pytest.raises(ValueError, match="score_shaper"):
        sparsity.SET(sparsity=0.5, update=1, score_shaper="rows")
    with pytest.raises(ValueError, match="tie_breaker"):
        sparsity.GMP(sparsity=0.5, update=1, tie_breaker="first")


# ------------------------------------------------------------------ 7. naming and loading
def test_a_user_class_named_like_a_built_in_is_refused():
    with pytest.raises(ValueError, match="'rigl' is built in"):
        class RigL(sparsity.DynamicSparsityAlgorithm):
            def update_mask(self, p, mask, sparsity):
                return mask
    assert sparsity.get_algorithm_class("rigl") is sparsity.RigL


def test_python_paths_make_a_class_named_in_a_config_loadable(tmp_path, monkeypatch):
    (tmp_path / "my_algos.py").write_text(textwrap.dedent("""
        import sparsity

        class PortedKeepAll(sparsity.SparsityAlgorithm):
            def update(self, optimizer=None):
                pass
    """))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv(sparsity.plugins.ENV_VAR, raising=False)
    with pytest.raises(ValueError, match="--python_paths"):
        sparsity.configure({"algorithm": "PortedKeepAll", "sparsity": 0.5})
    sparsity.plugins.add_python_paths([tmp_path])  # what the CLI flag does, before a worker reads it
    alg = sparsity.configure({"algorithm": "PortedKeepAll", "sparsity": 0.5})
    assert type(alg).__name__ == "PortedKeepAll"
    assert type(sparsity.configure({"algorithm": "my_algos.PortedKeepAll", "sparsity": 0.5})) is type(alg)
    with pytest.raises(ValueError, match="not a folder"):
        sparsity.plugins.add_python_paths([tmp_path / "absent"])


# ------------------------------------------------------------------- the porting module
def test_the_guides_sparsify_your_model_snippet_runs_with_one_import_changed():
    backend = cstorch.backend("CSX")
    with backend.device:
        model = TinyNet()
    compiled_model = cstorch.compile(model, backend)
    alg = cstorch.sparse.Static(sparsity=0.3)  # the guide calls it `sparsity`
    model.apply(alg)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.apply(alg)

    @cstorch.trace
    def training_step(x, y):
        loss = ((compiled_model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    losses = [float(training_step(torch.randn(8, 12), torch.randn(8, 6))) for _ in range(3)]
    assert all(math.isfinite(v) for v in losses)
    assert int((model.fc1.weight == 0).sum()) == 240 - sparsity.keep_count(240, 0.3)
    assert compiled_model is model and backend.backend_type == "CSX"


def test_configure_sparsity_wrapper_through_the_porting_module(tmp_path):
    model = TinyNet()
    optimizer = cstorch.sparse.configure_sparsity_wrapper(
        model, cstorch.optim.AdamW(model.parameters(), lr=1e-2),
        {"algorithm": "rigl", "sparsity": 0.8, "update": {"freq": 2}, "drop_fraction": 0.3})
    train_steps(model, optimizer, 3)
    cstorch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "c.mdl")
    state = cstorch.load(tmp_path / "c.mdl")
    # cstorch semantics: a configured Group saves one state per group
    assert int(state["optimizer"]["sparsity"][0]["step"]) == 3 and "fc1.weight_mask" in state["model"]
