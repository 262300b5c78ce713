import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsity import schedules
from sparsity.schedules import make_schedule, make_update_schedule


def test_cosine_drop_fraction_matches_rigl_paper_values():
    df = make_schedule({"type": "cosine", "init": 0.3, "half_period": 10000})
    got = [df(t) for t in (0, 2500, 5000, 7500, 10000)]
    assert got == pytest.approx([0.300, 0.256, 0.150, 0.044, 0.0], abs=5e-4)
    assert df(20000) == pytest.approx(0.0)  # held at the minimum after the half period


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
        ({"type": "exp", "init": 0.0, "gamma": math.log(2), "final": 0.8}, 1, 0.4),
        ({"type": "power", "init": 0.8, "beta": -1.0}, 3, 0.2),
        ({"type": "polynomial", "init": 0.0, "final": 0.8, "begin_step": 0, "end_step": 10, "power": 1}, 5, 0.4),
        ([0.1, 0.2, 0.3], 4, 0.2),
        (lambda t: 0.01 * t, 7, 0.07),
    ],
    ids=["float", "constant", "linear", "exp", "power", "polynomial", "cycling", "plain-lambda"],
)
def test_schedule_values(spec, step, value):
    assert make_schedule(spec)(step) == pytest.approx(value)


def test_cycling_moves_on_every_update_period():
    s = make_schedule([0.1, 0.2, 0.3], period=10)
    assert [s(t) for t in (0, 9, 10, 20, 30)] == [0.1, 0.1, 0.2, 0.3, 0.1]


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


@settings(max_examples=300, deadline=None)
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
