import math

import pytest

from sparsity.distributions import er, erk, get_distribution, uniform

MLP = {"fc1": (300, 784), "fc2": (100, 300), "fc3": (10, 100)}


@pytest.mark.parametrize(
    "target, expected",
    [(0.90, [0.9204, 0.7698, 0.0]), (0.95, [0.9615, 0.8887, 0.0815]), (0.98, [0.9846, 0.9555, 0.6326])],
)
def test_erk_reference_values(target, expected):
    got = erk(MLP, target)
    assert [got[n] for n in MLP] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("fn", [uniform, er, erk])
@pytest.mark.parametrize("target", [0.5, 0.9, 0.99])
def test_total_budget_is_kept(fn, target):
    got = fn(MLP, target)
    kept = sum((1 - got[n]) * math.prod(s) for n, s in MLP.items())
    assert kept == pytest.approx((1 - target) * sum(math.prod(s) for s in MLP.values()))
    assert all(0.0 <= v < 1.0 for v in got.values())


def test_unknown_distribution_lists_names():
    with pytest.raises(ValueError, match=r"'gauss'.*erk"):
        get_distribution("gauss")
