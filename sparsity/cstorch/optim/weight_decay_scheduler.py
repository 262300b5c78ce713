"""``cstorch.optim.weight_decay_scheduler``: cstorch's 19 weight-decay schedulers, the
schedulers of :mod:`.scheduler` (with their argument names) setting each param group's
``"weight_decay"``, which the optimizers read at every step."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import scheduler as s
from .scheduler import Tags

__all__ = [
    "WeightDecayScheduler", "ConstantWD", "PolynomialWD", "LinearWD", "ExponentialWD",
    "InverseExponentialTimeDecayWD", "InverseSquareRootDecayWD", "CosineDecayWD", "SequentialWD",
    "PiecewiseConstantWD", "MultiStepWD", "StepWD", "CosineAnnealingWD", "LambdaWD", "CosineAnnealingWarmRestartsWD",
    "MultiplicativeWD", "ChainedWD", "CyclicWD", "OneCycleWD", "ScalePerParamWD",
]


class WeightDecayScheduler(s.Scheduler):
    param_group_key = "weight_decay"


class ConstantWD(WeightDecayScheduler, s.ConstantScheduler):
    pass


class PolynomialWD(WeightDecayScheduler, s.PolynomialScheduler):
    pass


class LinearWD(WeightDecayScheduler, s.LinearScheduler):
    pass


class ExponentialWD(WeightDecayScheduler, s.ExponentialScheduler):
    pass


class InverseExponentialTimeDecayWD(WeightDecayScheduler, s.InverseExponentialTimeDecayScheduler):
    pass


class InverseSquareRootDecayWD(WeightDecayScheduler, s.InverseSquareRootDecayScheduler):
    pass


class CosineDecayWD(WeightDecayScheduler, s.CosineDecayScheduler):
    pass


class SequentialWD(WeightDecayScheduler, s.SequentialScheduler):
    pass


class PiecewiseConstantWD(WeightDecayScheduler, s.PiecewiseConstantScheduler):
    """``vals[i]`` until ``milestones[i]``, the last one after."""

    def __init__(self, optimizer: torch.optim.Optimizer, vals: Sequence[float], milestones: Sequence[int],
                 param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, ConstantWD, vals, milestones, param_group_tags)


class MultiStepWD(WeightDecayScheduler, s.MultiStepScheduler):
    pass


class StepWD(WeightDecayScheduler, s.StepScheduler):
    pass


class CosineAnnealingWD(WeightDecayScheduler, s.CosineAnnealingScheduler):
    pass


class LambdaWD(WeightDecayScheduler, s.LambdaScheduler):
    pass


class CosineAnnealingWarmRestartsWD(WeightDecayScheduler, s.CosineAnnealingWarmRestartsScheduler):
    pass


class MultiplicativeWD(WeightDecayScheduler, s.MultiplicativeScheduler):
    pass


class ChainedWD(WeightDecayScheduler, s.ChainedScheduler):
    pass


class CyclicWD(WeightDecayScheduler, s.CyclicScheduler):
    pass


class OneCycleWD(WeightDecayScheduler, s.OneCycleScheduler):
    pass


class ScalePerParamWD(WeightDecayScheduler, s.ScalePerParamScheduler):
    pass
