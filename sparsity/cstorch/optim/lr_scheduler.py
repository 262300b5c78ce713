"""``cstorch.optim.lr_scheduler``: every cstorch 2.x LR scheduler, with its arguments: the
schedulers of :mod:`.scheduler` setting each param group's ``"lr"``, their values named as
learning rates (``initial_learning_rate`` for ``initial_val``, ...)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import scheduler as s
from .scheduler import Tags

__all__ = [
    "LRScheduler", "ConstantLR", "PolynomialLR", "LinearLR", "ExponentialLR", "InverseExponentialTimeDecayLR",
    "InverseSquareRootDecayLR", "CosineDecayLR", "SequentialLR", "PiecewiseConstantLR", "MultiStepLR", "StepLR",
    "CosineAnnealingLR", "LambdaLR", "CosineAnnealingWarmRestarts", "MultiplicativeLR", "ChainedLR",
    "ChainedScheduler", "CyclicLR", "OneCycleLR", "ScalePerParamLR",
]

Optimizer = torch.optim.Optimizer


class LRScheduler(s.Scheduler):
    param_group_key = "lr"

    def get_last_lr(self) -> list[Any]:
        return self.get_last_value()


class ConstantLR(LRScheduler, s.ConstantScheduler):
    def __init__(self, optimizer: Optimizer, learning_rate: float, total_iters: int | None = None,
                 param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, learning_rate, total_iters, param_group_tags)


class PolynomialLR(LRScheduler, s.PolynomialScheduler):
    def __init__(self, optimizer: Optimizer, initial_learning_rate: float, end_learning_rate: float,
                 total_iters: int, power: float = 1.0, cycle: bool = False, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, initial_learning_rate, end_learning_rate, total_iters, power, cycle,
                         param_group_tags)


class LinearLR(LRScheduler, s.LinearScheduler):
    def __init__(self, optimizer: Optimizer, initial_learning_rate: float, end_learning_rate: float,
                 total_iters: int, cycle: bool = False, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, initial_learning_rate, end_learning_rate, total_iters, cycle, param_group_tags)


class ExponentialLR(LRScheduler, s.ExponentialScheduler):
    def __init__(self, optimizer: Optimizer, initial_learning_rate: float, total_iters: int, decay_rate: float,
                 staircase: bool = False, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, initial_learning_rate, total_iters, decay_rate, staircase, param_group_tags)


class InverseExponentialTimeDecayLR(LRScheduler, s.InverseExponentialTimeDecayScheduler):
    def __init__(self, optimizer: Optimizer, initial_learning_rate: float, step_exponent: int, total_iters: int,
                 decay_rate: float, staircase: bool = False, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, initial_learning_rate, step_exponent, total_iters, decay_rate, staircase,
                         param_group_tags)


class InverseSquareRootDecayLR(LRScheduler, s.InverseSquareRootDecayScheduler):
    def __init__(self, optimizer: Optimizer, initial_learning_rate: float = 1.0, scale: float = 1.0,
                 warmup_steps: int = 1, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, initial_learning_rate, scale, warmup_steps, param_group_tags)


class CosineDecayLR(LRScheduler, s.CosineDecayScheduler):
    def __init__(self, optimizer: Optimizer, initial_learning_rate: float, end_learning_rate: float,
                 total_iters: int, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, initial_learning_rate, end_learning_rate, total_iters, param_group_tags)


class SequentialLR(LRScheduler, s.SequentialScheduler):
    """``schedulers[i]`` from ``milestones[i-1]`` on, each counting from its own start."""


class PiecewiseConstantLR(LRScheduler, s.PiecewiseConstantScheduler):
    """``learning_rates[i]`` until ``milestones[i]``, the last one after."""

    def __init__(self, optimizer: Optimizer, learning_rates: Sequence[float], milestones: Sequence[int],
                 param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, ConstantLR, learning_rates, milestones, param_group_tags)


class MultiStepLR(LRScheduler, s.MultiStepScheduler):
    def __init__(self, optimizer: Optimizer, initial_learning_rate: float, gamma: float, milestones: Sequence[int],
                 param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, initial_learning_rate, gamma, milestones, param_group_tags)


class StepLR(LRScheduler, s.StepScheduler):
    def __init__(self, optimizer: Optimizer, initial_learning_rate: float, step_size: int, gamma: float,
                 param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, initial_learning_rate, step_size, gamma, param_group_tags)


class CosineAnnealingLR(LRScheduler, s.CosineAnnealingScheduler):
    def __init__(self, optimizer: Optimizer, initial_learning_rate: float, T_max: int,  # noqa: N803
                 eta_min: float = 0.0, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, initial_learning_rate, T_max, eta_min, param_group_tags)


class LambdaLR(LRScheduler, s.LambdaScheduler):
    def __init__(self, optimizer: Optimizer, initial_learning_rate: float, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, initial_learning_rate, param_group_tags)


class CosineAnnealingWarmRestarts(LRScheduler, s.CosineAnnealingWarmRestartsScheduler):
    def __init__(self, optimizer: Optimizer, initial_learning_rate: float, T_0: int,  # noqa: N803
                 T_mult: int = 1, eta_min: float = 0.0, param_group_tags: Tags = None) -> None:  # noqa: N803
        super().__init__(optimizer, initial_learning_rate, T_0, T_mult, eta_min, param_group_tags)


class MultiplicativeLR(LRScheduler, s.MultiplicativeScheduler):
    def __init__(self, optimizer: Optimizer, initial_learning_rate: float, coefficient: float,
                 param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, initial_learning_rate, coefficient, param_group_tags)


class ChainedLR(LRScheduler, s.ChainedScheduler):
    """The first scheduler's value times each other's value over its initial value."""


ChainedScheduler = ChainedLR


class CyclicLR(LRScheduler, s.CyclicScheduler):
    def __init__(self, optimizer: Optimizer, base_lr: float, max_lr: float, step_size_up: int = 2000,
                 step_size_down: int | None = None, mode: str = "triangular", gamma: float = 1.0,
                 scale_mode: str = "cycle", param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, base_lr, max_lr, step_size_up, step_size_down, mode, gamma, scale_mode,
                         param_group_tags)


class OneCycleLR(LRScheduler, s.OneCycleScheduler):
    def __init__(self, optimizer: Optimizer, initial_learning_rate: float, max_lr: float, total_steps: int = 1000,
                 pct_start: float = 0.3, final_div_factor: float = 1e4, three_phase: bool = False,
                 anneal_strategy: str = "cos", param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, initial_learning_rate, max_lr, total_steps, pct_start, final_div_factor,
                         three_phase, anneal_strategy, param_group_tags)


class ScalePerParamLR(LRScheduler, s.ScalePerParamScheduler):
    """``scheduler``'s value times each param group's ``adjust_learning_rate`` (default 1)."""
