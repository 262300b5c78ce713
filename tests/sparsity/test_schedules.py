import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparsity
from sparsity import schedules
from sparsity.schedules import make_schedule, make_update_schedule


def test_cosine_drop_fraction_matches_rigl_paper_values():
    df = make_schedule({"type": "cosine", "init": 0.3, "half_period": 10000})
    got = [df(t) for t in (0, 2500, 5000, 7500, 10000)]
    assert got == pytest.approx([0.300, 0.256, 0.150, 0.044, 0.0], abs=5e-4)
    assert df(20000) == pytest.approx(0.3)  # cstorch's cosine: back at init after a full period


def test_cubic_matches_zhu_gupta_check_values():
    s = make_schedule(
        {"type": "cubic", "init_sparsity": 0.0, "end_sparsity": 0.9, "sparsity_start_step": 0,
         "sparsity_end_step": 1000, "prune_every_k_steps": 100}
    )
    expected = [0, 0.244, 0.439, 0.591, 0.706, 0.788, 0.842, 0.876, 0.893, 0.899, 0.9]
    assert [s(100 * i) for i in range(11)] == pytest.approx(expected, abs=1e-3)
    assert s(150) == s(100)  # only changes every prune_every_k_steps
    assert s(5000) == pytest.approx(0.9)


@pytest.mark.parametrize(
    "spec, step, value",
    [
        (0.5, 123, 0.5),
        ({"type": "constant", "value": 0.7}, 9, 0.7),
        ({"type": "linear", "init": 0.1, "slope": 0.01}, 10, 0.2),
        ({"type": "exp", "init": 0.0, "gamma": -math.log(2), "final": 0.8}, 1, 0.4),
        ({"type": "power", "init": 0.8, "beta": 0.5}, 2, 0.2),
        ({"type": "polynomial", "init": 0.0, "final": 0.8, "begin_step": 0, "end_step": 10, "power": 1}, 5, 0.4),
        ([0.1, 0.2, 0.3], 4, 0.1),  # no cadence bound: the first value until update()
        (lambda t: 0.01 * t, 7, 0.07),
    ],
    ids=["float", "constant", "linear", "exp", "power", "polynomial", "cycling", "plain-lambda"],
)
def test_schedule_values(spec, step, value):
    assert make_schedule(spec)(step) == pytest.approx(value)


def test_cycling_moves_on_at_every_update_of_its_cadence():
    """cstorch's count: the initial mask (step 0, an update step of this cadence) takes the
    first value, each update the next; a drop fraction counts from step 1."""
    every_10 = make_update_schedule({"freq": 10})
    s = make_schedule([0.1, 0.2, 0.3], cadence=every_10)
    assert [s(t) for t in (0, 9, 10, 11, 20, 30)] == [0.1, 0.2, 0.2, 0.3, 0.3, 0.1]
    drop = make_schedule([0.1, 0.2, 0.3], cadence=every_10, first=1)
    assert [drop(t) for t in (10, 20, 30, 40)] == [0.1, 0.2, 0.3, 0.1]


def test_unknown_schedule_type_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown schedule type 'wiggle'.*cosine"):
        make_schedule({"type": "wiggle"})


def test_bad_schedule_arguments_are_value_errors():
    with pytest.raises(ValueError, match="cosine"):
        make_schedule({"type": "cosine", "init": 0.3})


def test_user_schedule_registers_by_lowercase_name():
    class HalfStepSchedule(schedules.Schedule):
        def __call__(self, step):
            return step / 2

    assert make_schedule({"type": "halfstep"})(4) == 2.0


@pytest.mark.parametrize(
    "spec, steps",
    [
        (3, [3, 6, 9, 12, 15, 18]),
        ({"freq": 5, "start": 2, "stop": 20}, [2, 7, 12, 17]),
        ({"steps": [4, 11]}, [4, 11]),
        (lambda t: t in (1, 2), [1, 2]),
        (None, []),
    ],
    ids=["int", "freq-start-stop", "steps", "callable", "never"],
)
def test_update_cadence(spec, steps):
    cadence = make_update_schedule(spec)
    assert [t for t in range(1, 21) if cadence(t)] == steps


@pytest.mark.parametrize(
    "spec, field",
    [({"freq": 0}, "freq"), ({"freq": 2, "start": 5, "stop": 5}, "stop"), ({"every": 3}, "keys"), ("x", "str")],
)
def test_bad_update_cadence(spec, field):
    with pytest.raises(ValueError, match=field):
        make_update_schedule(spec)


@settings(max_examples=300)
@given(freq=st.integers(1, 40), start=st.integers(0, 60), span=st.none() | st.integers(1, 200),
       until=st.integers(0, 400), steps=st.lists(st.integers(1, 300), max_size=6))
def test_last_update_equals_a_scan_of_every_step(freq, start, span, until, steps) -> None:
    """Plans ask for the last update of runs with millions of steps: the arithmetic answer
    must be the one a step-by-step scan gives."""
    from sparsity.schedules import AtSteps, Never, Periodic, UpdateWhen

    stop = None if span is None else start + span
    for schedule in (Periodic(freq, start, stop), AtSteps(steps), Never()):
        scan = UpdateWhen(schedule).last_update(until)
        assert schedule.last_update(until) == scan, (schedule, until)


# --------------------------------------- the YAML path against cerebras-pytorch 2.10's values
# tools/cstorch_oracle/scripts/schedules.py recorded, with the reference, every schedule type in
# each form at steps 0..42000, and the level GMP reads at each of 9 steps under four cadences.
ORACLE = torch.load(Path(__file__).resolve().parents[1] / "fixtures" / "cstorch_oracle" / "schedules.pt",
                    weights_only=True)
ORACLE_STEPS = [0, 1, 2, 3, 5, 8, 13, 100, 1000, 4999, 42000]
ORACLE_CADENCES = {"every_2": {"freq": 2}, "from_1_every_3": {"freq": 3, "start": 1, "stop": 8},
                   "listed": {"steps": [0, 3, 5]}, "listed_late": {"steps": [2, 6]}}
# the oracle's cases as a params file writes them (recorded as plain data; a lambda's step is an
# int here, and the instance is the engine's class)
YAML_FORMS = {key.split("/", 1)[1]: values[0] for key, values in ORACLE.items() if key.startswith("spec/")}
YAML_FORMS["lambda_dict"] = {"type": "lambda", "fn": lambda step: 0.5 * (1 - math.exp(-step / 100.0))}
YAML_FORMS["instance"] = schedules.Linear(init=0.25, slope=0.001)


def _within_float32_drift(ours: float, reference: float, step: int) -> bool:
    """Ours is float64, the reference float32, whose relative error grows with the step count
    (the rounding of ``beta`` in ``beta ** step``, of ``step * gamma``, of ``step * pi /
    half_period``); an overflow to inf in float32 is a float64 value beyond float32's range."""
    if math.isinf(reference):
        return abs(ours) > torch.finfo(torch.float32).max and math.copysign(1, ours) == math.copysign(1, reference)
    return math.isclose(ours, reference, rel_tol=max(1e-6, step * 2**-23), abs_tol=1e-6)


@pytest.mark.parametrize("case", sorted(YAML_FORMS))
def test_every_schedule_form_has_the_reference_values(case):
    """The schedule a params file builds: at cstorch's precision (its int64 step, float32) the
    reference's values bit for bit; at the YAML path's (float64) the same within float32's
    drift (docs/cstorch.md, "Schedules", gives the largest gaps)."""
    schedule = make_schedule(YAML_FORMS[case])
    reference = ORACLE[f"values/{case}"][0]
    if case != "lambda_dict":  # its function takes an int here, the reference's a tensor
        assert [schedule.compute(torch.tensor(step)).item() for step in ORACLE_STEPS] == reference
    ours = [schedule.value_at(step) for step in ORACLE_STEPS]
    assert all(_within_float32_drift(a, b, t) for a, b, t in zip(ours, reference, ORACLE_STEPS, strict=True)), (
        ours, reference)


@pytest.mark.parametrize("cadence", sorted(ORACLE_CADENCES))
@pytest.mark.parametrize("case", sorted({key.split("/")[1] for key in ORACLE if key.startswith("levels/")}))
def test_gmp_reads_the_reference_level_at_every_step(case, cadence):
    """``sparsity.configure`` as a params file reaches it: the level at optimizer steps 1-9
    (a cycling schedule moves on at the cadence's updates, the initial mask counting as one
    when the cadence includes step 0)."""
    gmp = sparsity.configure({"algorithm": "gmp", "sparsity": YAML_FORMS[case], "update": ORACLE_CADENCES[cadence]})
    ours = [gmp.target_sparsity(step) for step in range(1, 10)]
    reference = ORACLE[f"levels/{case}/{cadence}"]
    assert all(_within_float32_drift(a, b, t) for a, b, t in zip(ours, reference, range(1, 10), strict=True)), (
        ours, reference)


def test_the_issue_44_gmp_sections_are_read_as_on_a_cs_system():
    """Refused before (``sparsity must be in [0, 1) at step 42000, got -52.5``), or 4202.3."""
    exp = sparsity.configure({"algorithm": "gmp", "update": {"freq": 1000},
                              "sparsity": {"type": "exp", "init": 0, "gamma": -0.0001, "final": 0.8}})
    assert exp.target_sparsity(42000) == pytest.approx(ORACLE["values/exp_gmp"][0][-1], abs=1e-7)  # 0.78800
    power = sparsity.configure({"algorithm": "gmp", "update": {"freq": 1000},
                                "sparsity": {"type": "power", "init": 0.9, "beta": 0.9999977}})
    # the reference's 0.81628 is float32's beta ** 42000; the exact value is 0.81713
    assert power.target_sparsity(42000) == pytest.approx(0.9 * 0.9999977**42000, rel=1e-12)
    assert power.target_sparsity(42000) == pytest.approx(ORACLE["values/power"][0][-1], rel=2e-3)


def test_a_cycling_level_under_a_callable_cadence_counts_each_step_once():
    """Metrics ask the level at every step: the count of a callable cadence's updates goes on
    from the last step asked, so a run of T steps calls the cadence ~T times, not T²/2."""
    calls = []
    cadence = schedules.UpdateWhen(lambda step: calls.append(step) or step % 3 == 0)
    level = make_schedule([0.1, 0.2, 0.3, 0.4], cadence=cadence)
    assert [level(t) for t in range(1, 11)] == [0.2, 0.2, 0.2, 0.3, 0.3, 0.3, 0.4, 0.4, 0.4, 0.1]
    assert len(calls) == 10 and level(4) == 0.3  # an earlier step counts again from the start
