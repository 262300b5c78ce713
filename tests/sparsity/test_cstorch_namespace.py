"""``sparsity.cstorch`` as a cstorch script meets it (issue 23): the namespace as attributes and
submodules, cstorch's extension contract, GradScaler skips, checkpoints loaded with plain
``load_state_dict``, the 2.0-era entry points and ``add_summaries``. The recorded comparison
with the reference itself is test_cstorch_oracle.py."""

from __future__ import annotations

import importlib
import math
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import sparsity.cstorch as cstorch


def mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def step(model, optimizer, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    inputs, targets = torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(inputs), targets) * scale
    loss.backward()
    optimizer.step()
    return loss.detach()


def masks(model) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith("_mask")}


# ------------------------------------------------------------------------- the namespace
@pytest.mark.parametrize("path", [
    "sparsity.cstorch.sparse.RigL", "sparsity.cstorch.sparse.rigl.RigL", "sparsity.cstorch.sparse.utils.make_mask_topk_sparsity",
    "sparsity.cstorch.sparse.utils.make_mask_drop_minimum", "sparsity.cstorch.sparse.utils.make_mask_grow_maximum",
    "sparsity.cstorch.sparse.init.random", "sparsity.cstorch.amp.GradScaler", "sparsity.cstorch.amp.use_bfloat16",
    "sparsity.cstorch.amp.update_if_finite", "sparsity.cstorch.optim.lr_scheduler.CosineDecayLR",
    "sparsity.cstorch.optim.configure_optimizer", "sparsity.cstorch.optim.configure_lr_scheduler",
    "sparsity.cstorch.utils.data.DataExecutor", "sparsity.cstorch.utils.data.DataLoader",
    "sparsity.cstorch.checkpoint_closure", "sparsity.cstorch.step_closure", "sparsity.cstorch.name_scope",
    "sparsity.cstorch.summarize_scalar", "sparsity.cstorch.sparse.configure_sparsity_wrapper",
])
def test_a_cstorch_name_imports_as_a_submodule_member(path):
    module_path, _, name = path.rpartition(".")
    assert callable(getattr(importlib.import_module(module_path), name))


def test_from_sparse_import_works_and_the_package_imports_only_torch():
    code = ("import sys; from sparsity.cstorch.sparse import RigL, Group; "
            "from sparsity.cstorch.sparse.utils import make_mask_grow_maximum; import sparsity.cstorch; "
            "bad = [m for m in ('pydantic', 'yaml', 'ray', 'mlflow', 'workers', 'service', 'simulator') "
            "if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_cstorch_lr_scheduler_name_is_there():
    names = ["ConstantLR", "PolynomialLR", "LinearLR", "ExponentialLR", "InverseExponentialTimeDecayLR",
             "InverseSquareRootDecayLR", "CosineDecayLR", "SequentialLR", "PiecewiseConstantLR", "MultiStepLR",
             "StepLR", "CosineAnnealingLR", "LambdaLR", "CosineAnnealingWarmRestarts", "MultiplicativeLR",
             "ChainedLR", "ChainedScheduler", "CyclicLR", "OneCycleLR", "ScalePerParamLR"]
    assert [n for n in names if not hasattr(cstorch.optim.lr_scheduler, n)] == []


def test_every_cstorch_weight_decay_scheduler_and_generic_scheduler_is_there():
    closed_forms = ["Constant", "Polynomial", "Linear", "Exponential", "InverseExponentialTimeDecay",
                    "InverseSquareRootDecay", "CosineDecay", "Sequential", "PiecewiseConstant", "MultiStep", "Step",
                    "CosineAnnealing", "Lambda", "CosineAnnealingWarmRestarts", "Multiplicative", "Chained", "Cyclic",
                    "OneCycle", "ScalePerParam"]
    decay, generic = cstorch.optim.weight_decay_scheduler, cstorch.optim.scheduler
    assert [n for n in closed_forms if not hasattr(decay, f"{n}WD")] == []
    assert [n for n in closed_forms if not hasattr(generic, f"{n}Scheduler")] == []
    assert issubclass(decay.CosineDecayWD, generic.CosineDecayScheduler)
    with pytest.raises(TypeError):  # abstract: a scheduler names the value it sets
        generic.ConstantScheduler(cstorch.optim.SGD(mlp().parameters(), lr=0.1), val=0.5)


def test_cstorchs_adafactor_takes_its_arguments_and_names_what_it_does_not_support():
    params = list(mlp().parameters())
    adafactor = cstorch.optim.Adafactor(params, lr=0.01, decay_rate=-0.6, scale_parameter=False, eps=(1e-30, 1e-2))
    assert adafactor.defaults["decay_rate"] == -0.6 and sorted(adafactor.state[params[0]]) == [
        "exp_avg_sq_col", "exp_avg_sq_row", "step"]
    with pytest.raises(ValueError, match="beta1=0.9"):
        cstorch.optim.Adafactor(params, lr=0.01, beta1=0.9)
    assert cstorch.optim.Rprop(params).defaults["lr"] == 0.001 and cstorch.optim.RAdam(params).defaults["eps"] == 1e-6


# ------------------------------------------------------------------ extension contract
class RoundingKeep(cstorch.sparse.DynamicSparsityAlgorithm):
    """Written to cstorch's contract: tensor sparsity, tensor is_update_step, tensor step."""

    seen: list = []

    def update_mask(self, p, mask, sparsity):
        keep = ((1 - sparsity) * p.numel()).round()  # fails on a float sparsity
        type(self).seen.append((self.step.clone(), self.is_update_step.clone(), keep))
        score = torch.where(self.is_update_step, p.abs(), mask.float())
        return cstorch.sparse.utils.make_mask_topk_sparsity(score, sparsity)


def test_update_mask_gets_tensors_every_step_and_update_none_means_every_step():
    RoundingKeep.seen = []
    model = mlp()
    alg = RoundingKeep(sparsity=0.5, update={"freq": 2})
    alg.apply(model)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.apply(alg)
    for i in range(4):
        step(model, optimizer, i)
    steps = [int(s) for s, _, _ in RoundingKeep.seen[::4]]
    flags = [bool(u) for _, u, _ in RoundingKeep.seen[::4]]
    assert steps == [1, 2, 3, 4] and flags == [False, True, False, True]
    assert isinstance(alg.step, torch.Tensor) and alg.step.dtype == torch.int64
    every = cstorch.sparse.SET(sparsity=0.5)  # cstorch: no update means every step
    assert all(bool(every.update_schedule(torch.tensor(t))) for t in range(5))


def test_a_cycling_schedule_advances_once_per_update_step_through_update():
    schedule = cstorch.sparse.utils.make_hyperparam_schedule([0.2, 0.4, 0.6])
    values = []
    for t in range(4):
        values.append(float(schedule(torch.tensor(t))))
        is_update_step = torch.tensor(True)  # an algorithm's one flag of this step
        for _ in range(3):  # three parameters share it: one advance per step
            schedule.update(is_update_step)
        schedule.cache_clear()
    assert values == pytest.approx([0.2, 0.4, 0.6, 0.2])


class Staircase(cstorch.sparse.utils.HyperParameterSchedule):
    """A user schedule keeping its state in ``update()``, as cstorch's ``Cycling`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.climbed = torch.tensor(0)

    def compute(self, step):
        return 0.2 + 0.1 * self.climbed.float()

    def update(self, is_update_step):
        self.climbed = self.climbed + is_update_step.long()


class CountedStaircase(Staircase):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def update(self, is_update_step):
        self.calls += 1
        super().update(is_update_step)


@settings(max_examples=25)
@given(layers=st.integers(1, 4), freq=st.integers(1, 3), start=st.integers(0, 2), steps=st.integers(1, 5),
       counted=st.booleans())
def test_a_user_schedule_overriding_update_advances_once_per_step_however_many_parameters_share_it(
        layers, freq, start, steps, counted):
    schedule = CountedStaircase() if counted else Staircase()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])  # 2 * layers parameters share it
    alg = cstorch.sparse.GMP(sparsity=schedule, update={"freq": freq, "start": start})
    alg.apply(model)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.apply(alg)
    alg.initialize()
    for i in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).square().mean().backward()
        optimizer.step()
    # once at apply if the run starts sparse, then once per update step (the reference's counts)
    update_steps = [t for t in range(1, steps + 1) if t >= start and (t - start) % freq == 0]
    assert int(schedule.climbed) == (start == 0) + len(update_steps)
    if counted:  # its super().update() ran the parent's; the wrapped update itself ran once per step
        assert schedule.calls == 1 + steps


def test_a_cycling_sparsity_updated_every_step_moves_on_at_the_first_step_too():
    model = mlp()
    alg = cstorch.sparse.GMP(sparsity=[0.2, 0.4, 0.6, 0.8])
    alg.apply(model)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.apply(alg)
    alg.initialize()
    levels = []
    alg.register_target_sparsity_hook(lambda _alg, _name, level: levels.append(round(float(level), 2)))
    for i in range(4):
        step(model, optimizer, i)
    assert levels == [0.4, 0.6, 0.8, 0.2]  # cerebras-pytorch 2.10's values (apply moved it to 0.4)


def test_a_step_closure_called_inside_a_traced_step_sees_its_arguments_as_they_were_then():
    seen = []

    @cstorch.step_closure
    def log(counter, nested):
        seen.append((int(counter), float(nested["weights"][0].sum())))

    counter, weight = torch.tensor(0), torch.ones(3)

    @cstorch.trace
    def training_step():
        log(counter, {"weights": [weight]})
        counter.add_(1)
        weight.mul_(5)

    training_step()
    assert seen == [(0, 3.0)] and int(counter) == 1


def test_a_score_shaper_object_is_honoured_by_rigl_and_the_mask_helpers():
    class Halves(cstorch.sparse.utils.ScoreShaper):
        def __call__(self, tensor):
            return tensor.reshape(2, -1), lambda rows: rows.reshape(tensor.shape)

    score = torch.arange(32.0).reshape(4, 8)  # unshaped top-k would take the last rows only
    mask = cstorch.sparse.utils.make_mask_topk_sparsity(score, torch.tensor(0.5), Halves())
    assert mask.reshape(2, -1).sum(1).tolist() == [8, 8]
    model = mlp()
    alg = cstorch.sparse.RigL(sparsity=0.5, score_shaper=Halves())
    alg.apply(model)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.apply(alg)
    alg.initialize()
    for i in range(3):
        step(model, optimizer, i)
    assert model[0].weight_mask.reshape(2, -1).sum(1).tolist() == [32, 32]


def test_a_tiebreaker_object_decides_gmp_ties():
    class PreferLast(cstorch.sparse.utils.ScoreTiebreaker):
        def __call__(self, score):
            return score + torch.arange(score.numel()).reshape(score.shape) * 1e-6

    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    alg = cstorch.sparse.GMP(sparsity=[0.0, 0.5], update={"steps": [0, 1]}, tiebreak=PreferLast())
    alg.apply(model)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.0)
    optimizer.apply(alg)
    alg.initialize()
    optimizer.zero_grad()
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    assert model.weight_mask.tolist() == [[False, False, True, True]]


def test_hooks_fire_every_step_with_a_name_glob_and_tensors():
    calls = []
    model = mlp()
    alg = cstorch.sparse.SET(sparsity=0.5, update={"freq": 3})
    alg.register_target_sparsity_hook(lambda a, name, value: calls.append(("target", name, value)))
    alg.register_computed_sparsity_hook(lambda a, name, value: calls.append(("actual", name, value)))
    alg.apply(model)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.apply(alg)
    for i in range(2):
        step(model, optimizer, i)
    targets = [c for c in calls if c[0] == "target"]
    assert [c[1] for c in targets] == ["*", "*"]  # common prefix of 0.weight, 0.bias, 2.weight, 2.bias
    assert all(isinstance(c[2], torch.Tensor) for c in calls)
    assert len([c for c in calls if c[0] == "actual"]) == 8


# ------------------------------------------------------------------------ GradScaler
def test_a_skipped_step_moves_neither_the_sparsity_step_nor_the_lr_schedule():
    model = mlp()
    alg = cstorch.sparse.RigL(sparsity=0.5, update={"freq": 1})
    alg.apply(model)
    optimizer = cstorch.optim.AdamW(model.parameters(), lr=0.01)
    optimizer.apply(alg)
    scheduler = cstorch.optim.lr_scheduler.LinearLR(optimizer, initial_learning_rate=0.01, end_learning_rate=0.0,
                                                    total_iters=10)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=8.0)
    alg.initialize()
    for i, factor in enumerate([1.0, float("inf"), 1.0]):
        generator = torch.Generator().manual_seed(i)
        loss = torch.nn.functional.mse_loss(model(torch.randn(6, 8, generator=generator)),
                                            torch.randn(6, 4, generator=generator)) * factor
        before = masks(model), [p.detach().clone() for p in model.parameters()]
        cstorch.amp.optimizer_step(loss, optimizer, scaler, max_gradient_norm=1.0)
        scheduler.step()
        if factor != 1.0:
            assert all(torch.equal(a, b) for a, b in zip(before[0].values(), masks(model).values()))
            assert all(torch.equal(a, b) for a, b in zip(before[1], model.parameters()))
    assert int(alg.step) == 2 and scheduler.last_epoch == 2
    assert int(scaler.get_num_skipped_steps()) == 1 and float(scaler.get_scale()) == 4.0


def test_a_skipped_first_step_leaves_a_lazily_built_optimizer_state_unbuilt():
    """The skipped step runs (its random draws stay in the global stream) and is rolled back:
    the state a torch-backed optimizer builds on its first step is dropped again."""
    model = mlp()
    alg = cstorch.sparse.SET(sparsity=0.5)
    alg.apply(model)
    optimizer = cstorch.optim.RMSprop(model.parameters())
    optimizer.apply(alg)
    alg.initialize()
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=1.0, min_loss_scale=1.0, max_loss_scale=1.0)
    torch.manual_seed(3)
    loss = model(torch.randn(6, 8)).square().mean() * float("inf")
    weights, before = [p.detach().clone() for p in model.parameters()], masks(model)  # pruned by the forward
    cstorch.amp.optimizer_step(loss, optimizer, scaler)
    after_skip = torch.rand(1)
    torch.manual_seed(3)
    torch.randn(6, 8)
    for p in model.parameters():  # SET's draw on the skipped step, one per parameter with a gradient
        torch.rand_like(p)
    assert torch.equal(torch.rand(1), after_skip)
    assert not optimizer.state and int(alg.step) == 0
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before.values(), masks(model).values()))


def test_load_reads_numpy_values_and_nothing_else_a_pickle_can_hold(tmp_path):
    np = pytest.importorskip("numpy")
    np.random.seed(0)
    cstorch.save({"rng": np.random.get_state(), "step": np.int64(7), "loss": np.float32(0.5),
                  "history": np.arange(4.0), "w": torch.ones(2)}, tmp_path / "numpy.mdl")
    state = cstorch.load(tmp_path / "numpy.mdl")
    np.random.set_state(state["rng"])
    assert np.random.rand() == pytest.approx(0.5488135039273248)  # np.random.seed(0)'s first draw
    assert state["step"] == 7 and state["loss"] == np.float32(0.5) and state["history"].tolist() == [0, 1, 2, 3]
    cstorch.save({"callable": math.floor}, tmp_path / "code.mdl")  # a pickle may name any global
    cstorch.save({"objects": np.array([None, 1], dtype=object)}, tmp_path / "objects.mdl")
    for refused in ("code.mdl", "objects.mdl"):
        with pytest.raises(pickle.UnpicklingError):
            cstorch.load(tmp_path / refused)


def test_a_constant_loss_scale_scales_and_unscales_to_the_same_gradients():
    torch.manual_seed(0)
    weights = torch.nn.Parameter(torch.randn(3))
    optimizer = cstorch.optim.SGD([weights], lr=0.0)
    scaler = cstorch.amp.GradScaler(loss_scale=128.0)
    scaler.scale((weights ** 2).sum()).backward()
    scaler.unscale_(optimizer)
    assert torch.allclose(weights.grad, 2 * weights.detach())
    with pytest.raises(ValueError, match="loss_scale"):
        cstorch.amp.GradScaler(loss_scale="sometimes")


# ------------------------------------------------------------------------- checkpoints
def test_a_nan_sentinel_checkpoint_loads_strictly_through_load_state_dict():
    model = mlp(1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["0.weight"][:, ::2] = float("nan")  # cstorch 1.x: pruned weights stored as NaN
    fresh = mlp(2)
    alg = cstorch.sparse.configure({"algorithm": "set", "sparsity": 0.5})
    alg.apply(fresh)
    optimizer = cstorch.optim.SGD(fresh.parameters(), lr=0.1)
    optimizer.apply(alg)
    fresh.load_state_dict(state)  # strict: the _mask buffer comes from the NaN pattern
    alg.initialize()
    expected = torch.ones(16, 8, dtype=torch.bool)
    expected[:, ::2] = False
    assert torch.equal(fresh[0].weight_mask, expected)
    losses = [step(fresh, optimizer, i) for i in range(3)]
    assert all(math.isfinite(float(v)) for v in losses)
    assert not torch.isnan(fresh[0].weight).any() and not fresh[0].weight[~fresh[0].weight_mask].any()


@settings(max_examples=8)
@given(old=st.sampled_from([0.3, 0.5, 0.7]), new=st.sampled_from([0.2, 0.5, 0.8]))
def test_a_changed_level_across_a_restart_is_applied_with_a_warning(old, new):
    model = mlp(3)
    alg = cstorch.sparse.Static(sparsity=old)
    alg.apply(model)
    alg.initialize()
    saved = model.state_dict()
    fresh = mlp(4)
    resumed = cstorch.sparse.Static(sparsity=new)
    resumed.apply(fresh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_state_dict(saved)
    resumed.initialize()
    for name, mask in masks(fresh).items():
        numel = mask.numel()
        assert int(mask.sum()) == int(torch.tensor(1 - new, dtype=torch.float32) * numel), name
        old_mask = saved[name]
        if new >= old:  # pruning further keeps a subset of what the checkpoint kept
            assert not (mask & ~old_mask).any()
    assert any("configured sparsity" in str(w.message) for w in caught) == (old != new)


# ------------------------------------------------------------------- 2.0 entry points
def test_configure_sparsity_wrapper_with_the_2_0_signature_trains_and_checkpoints():
    model = mlp()
    optimizer = cstorch.sparse.configure_sparsity_wrapper(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "rigl", sparsity=0.75, schedule=2,
        param_name_patterns=r"\.weight$")
    assert isinstance(optimizer, torch.optim.Optimizer)
    for i in range(4):
        step(model, optimizer, i)
    state = optimizer.state_dict()
    assert int(state["sparsity"][0]["step"]) == 4
    assert sorted(masks(model)) == ["0.weight_mask", "2.weight_mask"]
    assert int(model[0].weight_mask.sum()) == 32


def test_configure_sparsity_optimizer_hook_module_and_initialize_sparsity():
    model = mlp()
    sparsity_opt = cstorch.sparse.configure_sparsity_optimizer(
        "gmp", list(model.named_parameters()),
        param_name_patterns={"0.weight": {"sparsity_schedule": [[0, 0.25], [2, 0.5]]}, "2.weight": None},
        sparsity_schedule=[[0, 0.5], [2, 0.75]])
    sparsity_opt.hook_module(model)
    sparsity_opt.initialize_sparsity()
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
    sparsity_opt.apply(optimizer)
    assert (int(model[0].weight_mask.sum()), int(model[2].weight_mask.sum())) == (96, 32)
    for i in range(2):
        step(model, optimizer, i)
    assert (int(model[0].weight_mask.sum()), int(model[2].weight_mask.sum())) == (64, 16)


def test_add_summaries_in_a_config_section_logs_target_and_actual():
    cstorch.summaries.clear()
    model = mlp()
    alg = cstorch.sparse.configure({"algorithm": "set", "sparsity": 0.5, "add_summaries": True})
    alg.apply(model)
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.apply(alg)
    alg.initialize()
    step(model, optimizer, 0)
    assert cstorch.summaries["sparsity/*/target"] == [(0, 0.5)]
    assert sorted(k for k in cstorch.summaries if k.endswith("/actual")) == [
        "sparsity/0.weight/actual", "sparsity/2.weight/actual"]


# -------------------------------------------------------------------- run loop pieces
def test_step_closures_run_after_the_traced_step_and_checkpoint_closures_on_checkpoint_steps():
    order, saved = [], []

    @cstorch.step_closure
    def log(value):
        order.append(("closure", value))

    @cstorch.checkpoint_closure
    def save(step_number):
        saved.append(step_number)

    @cstorch.trace
    def training_step(value):
        log(value)
        order.append(("step", value))

    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: [1, 2, 3]), num_steps=7,
                                               checkpoint_steps=3)
    for number, value in enumerate(executor, start=1):
        training_step(value)
        save(number)
    assert order[:4] == [("step", 1), ("closure", 1), ("step", 2), ("closure", 2)]
    assert saved == [3, 6, 7]
    with pytest.raises(RuntimeError, match="outside of an execution context"):
        save(1)


def test_configure_optimizer_and_lr_scheduler_read_modelzoo_sections():
    model = mlp()
    optimizer = cstorch.optim.configure_optimizer("adamw", model.parameters(), learning_rate=0.01,
                                                  weight_decay=0.1, betas=(0.9, 0.95))
    assert isinstance(optimizer, cstorch.optim.AdamW) and optimizer.param_groups[0]["lr"] == 0.01
    scheduler = cstorch.optim.configure_lr_scheduler(optimizer, [
        {"scheduler": "Linear", "initial_learning_rate": 0.0, "end_learning_rate": 0.01, "total_iters": 2},
        {"scheduler": "CosineDecay", "initial_learning_rate": 0.01, "end_learning_rate": 0.0, "total_iters": 2},
    ])
    values = [optimizer.param_groups[0]["lr"]]
    for _ in range(4):
        scheduler.step()
        values.append(optimizer.param_groups[0]["lr"])
    assert values == pytest.approx([0.0, 0.005, 0.01, 0.005, 0.0], abs=1e-7)
    with pytest.raises(ValueError, match="weight_decay_rate"):
        cstorch.optim.configure_optimizer("adamw", model.parameters(), weight_decay_rate=0.1)
    with pytest.raises(ValueError, match="decay_steps"):
        cstorch.optim.configure_lr_scheduler(optimizer, {"scheduler": "linear", "decay_steps": 3})


# ------------------------------------------------------------------------- mask algebra
@settings(max_examples=40)
@given(rows=st.sampled_from([1, 2, 4]), row_len=st.integers(1, 40), level=st.floats(0.0, 0.99),
       drop=st.floats(0.0, 1.0), seed=st.integers(0, 10_000))
@example(rows=1, row_len=3, level=1 / 3, drop=0.0, seed=0)  # the reference keeps 1 of 3 here
def test_drop_then_grow_keeps_cstorch_counts(rows, row_len, level, drop, seed):
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(rows * row_len, generator=generator)
    shaper = cstorch.sparse.utils.OutputGroupScoreShaper(rows)
    utils = cstorch.sparse.utils
    # As cstorch computes it: 1 - sparsity on the float32 tensor, times the row length, truncated
    # (level 1/3 of 3 keeps 1: f32(1 - f32(1/3)) * 3 = 1.9999999).
    target = int((1 - torch.tensor(level)) * torch.tensor(float(row_len)))
    mask = utils.make_mask_topk_sparsity(weights.abs(), torch.tensor(level), shaper)
    assert mask.reshape(rows, -1).sum(1).tolist() == [target] * rows
    kept_mask, kept = utils.make_mask_drop_minimum(weights.abs(), mask, torch.tensor(drop), shaper)
    assert kept_mask.reshape(rows, -1).sum(1).tolist() == [int(kept)] * rows
    grown = utils.make_mask_grow_maximum(torch.rand(rows * row_len, generator=generator), kept_mask,
                                         torch.tensor(level), kept, shaper)
    assert (grown & kept_mask).equal(kept_mask)
    assert grown.reshape(rows, -1).sum(1).tolist() == [max(target, int(kept))] * rows


def test_our_own_configure_accepts_add_summaries_and_names_a_bad_value():
    import sparsity

    assert isinstance(sparsity.configure({"sparsity": 0.5, "add_summaries": True}), sparsity.Static)
    with pytest.raises(ValueError, match="add_summaries"):
        sparsity.configure({"sparsity": 0.5, "add_summaries": "yes"})


def test_our_own_configure_sparsity_wrapper_takes_the_2_0_signature_too():
    import sparsity

    model = mlp()
    wrapper = sparsity.configure_sparsity_wrapper(model, torch.optim.SGD(model.parameters(), lr=0.1), "rigl",
                                                  sparsity=0.75, schedule=2, param_name_patterns=r"0\.weight")
    for i in range(4):
        step(model, wrapper, i)
    assert sorted(masks(model)) == ["0.weight_mask"] and int(model[0].weight_mask.sum()) == 32
    assert wrapper.state_dict()["sparsity"]["step"] == 4
    with pytest.raises(ValueError, match="keyword options"):
        sparsity.configure_sparsity_wrapper(model, torch.optim.SGD(model.parameters(), lr=0.1), {"sparsity": 0.5},
                                            schedule=2)


def test_use_bfloat16_picks_the_half_type_autocast_runs_in():
    model = mlp()
    try:
        cstorch.amp.use_bfloat16(True)
        with cstorch.amp.autocast():
            assert model(torch.randn(2, 8)).dtype == torch.bfloat16
        cstorch.amp.set_half_dtype("float16")
        assert cstorch.amp.get_half_dtype() == torch.float16
        with pytest.raises(ValueError, match="half dtype"):
            cstorch.amp.set_half_dtype("float8")
    finally:
        cstorch.amp.set_half_dtype("float16")


def test_an_lr_scheduler_resumes_from_its_state_dict_nested_ones_included():
    def build():
        optimizer = cstorch.optim.SGD(mlp().parameters(), lr=1.0)
        lr = cstorch.optim.lr_scheduler
        scheduler = lr.SequentialLR(optimizer, [lr.LinearLR(optimizer, initial_learning_rate=0.0, end_learning_rate=0.1,
                                                            total_iters=3),
                                                lr.StepLR(optimizer, initial_learning_rate=0.1, step_size=2, gamma=0.5)],
                                    milestones=[3])
        return optimizer, scheduler

    optimizer, scheduler = build()
    for _ in range(5):
        scheduler.step()
    saved = scheduler.state_dict()
    expected = []
    for _ in range(3):
        scheduler.step()
        expected.append(optimizer.param_groups[0]["lr"])
    optimizer, resumed = build()
    resumed.load_state_dict(saved)
    got = []
    for _ in range(3):
        resumed.step()
        got.append(optimizer.param_groups[0]["lr"])
    assert got == pytest.approx(expected) and resumed.last_epoch == 8


def test_our_own_api_honours_shapers_and_tie_breakers_written_to_cstorchs_call_protocol():
    import sparsity

    class Halves(sparsity.ScoreShaper):
        def __call__(self, tensor):
            return tensor.reshape(2, -1), lambda rows: rows.reshape(tensor.shape)

    model = mlp()
    alg = sparsity.SET(sparsity=0.5, update={"freq": 1}, score_shaper=Halves(), param_filter="0.weight")
    model.apply(alg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    alg.apply(optimizer)
    for i in range(3):
        step(model, optimizer, i)
    assert model[0].weight_mask.reshape(2, -1).sum(1).tolist() == [32, 32]

    class PreferLast(sparsity.ScoreTieBreaker):
        def __call__(self, score):
            return score + torch.arange(score.numel()).reshape(score.shape) * 1e-6

    tied = torch.ones(1, 6)
    assert sparsity.topk_mask(tied, 2, PreferLast()).tolist() == [[False] * 4 + [True] * 2]
    assert sparsity.topk_mask(tied, 2).tolist() == [[True] * 2 + [False] * 4]


def test_our_own_api_loads_nan_sentinel_and_dense_checkpoints_and_applies_a_changed_level():
    import sparsity

    def sparse_model(level, seed):
        model = mlp(seed)
        alg = sparsity.Static(sparsity=level)
        model.apply(alg)
        return model, alg

    saved, _ = sparse_model(0.5, 1)
    checkpoint = saved.state_dict()
    nan_form = {k: v for k, v in sparsity.checkpoint.finalize(checkpoint, mode="nan").items()}
    model, _ = sparse_model(0.5, 2)
    model.load_state_dict(nan_form)  # strict, no _mask keys
    assert torch.equal(model[0].weight_mask, checkpoint["0.weight_mask"])
    assert not torch.isnan(model[0].weight).any()

    dense = mlp(3).state_dict()
    model, _ = sparse_model(0.5, 2)
    before = model[0].weight_mask.clone()
    model.load_state_dict(dense)  # a dense start: our mask stays, the loaded weights are masked
    assert torch.equal(model[0].weight_mask, before) and not model[0].weight[~before].any()

    model, _ = sparse_model(0.8, 4)
    with pytest.warns(UserWarning, match="configured"):
        model.load_state_dict(checkpoint)  # a 50% checkpoint under an 80% config
    kept = model[0].weight_mask
    assert int(kept.sum()) == sparsity.keep_count(128, 0.8) and not (kept & ~checkpoint["0.weight_mask"]).any()
