"""``cstorch.optim.lr_scheduler``: every cstorch 2.x LR scheduler, with its arguments.

Each is a closed form of ``last_epoch`` (the number of ``step()`` calls): building one sets the
learning rate to its value at 0, each ``step()`` to the value at the next epoch, as cstorch
does. A step that the GradScaler skipped (non-finite gradients) does not move ``last_epoch``,
so the schedule stays in step with the sparsity ``step`` (cstorch rolls both back).
``param_group_tags`` restricts a scheduler to the param groups whose ``tags`` share one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "LRScheduler", "ConstantLR", "PolynomialLR", "LinearLR", "ExponentialLR", "InverseExponentialTimeDecayLR",
    "InverseSquareRootDecayLR", "CosineDecayLR", "SequentialLR", "PiecewiseConstantLR", "MultiStepLR", "StepLR",
    "CosineAnnealingLR", "LambdaLR", "CosineAnnealingWarmRestarts", "MultiplicativeLR", "ChainedLR",
    "ChainedScheduler", "CyclicLR", "OneCycleLR", "ScalePerParamLR",
]

Tags = str | Sequence[str | None] | None


def _f32(value: Any) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32)


class LRScheduler:
    """Base: subclasses give ``_value(epoch) -> 0-d tensor``."""

    param_group_key = "lr"

    def __init__(self, optimizer: torch.optim.Optimizer, total_iters: int | None = None,
                 param_group_tags: Tags = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{type(self).__name__}: optimizer must be a torch optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.total_iters = total_iters
        self.param_group_tags = _tag_set(param_group_tags)
        if self.param_group_tags is not None and not any(self._applies_to(g) for g in optimizer.param_groups):
            raise ValueError(f"{type(self).__name__}: param_group_tags {sorted(map(str, self.param_group_tags))} "
                             "match no param group of the optimizer")
        self.last_epoch = 0
        self._last_value: list[Any] = []
        self._write_values()

    # ------------------------------------------------------------------ stepping
    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _applies_to(self, group: dict[str, Any]) -> bool:
        if self.param_group_tags is None:
            return True
        return bool(self.param_group_tags & (_tag_set(group.get("tags")) or {None}))

    def get(self) -> list[Any]:
        value = float(self._value(torch.tensor(float(self.last_epoch))))
        return [value if self._applies_to(g) else None for g in self.optimizer.param_groups]

    def _write_values(self) -> None:
        self._last_value = self.get()
        for group, value in zip(self.optimizer.param_groups, self._last_value):
            if value is not None:
                group[self.param_group_key] = value

    def step(self, *args: Any, **kwargs: Any) -> None:
        if getattr(self.optimizer, "_cstorch_step_skipped", False):
            return
        self.last_epoch += 1
        self._write_values()

    def get_last_value(self) -> list[Any]:
        return list(self._last_value)

    get_last_lr = get_last_value

    # --------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Plain values; schedulers held inside (Sequential, Chained, ScalePerParam) as their
        own state dicts."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_schedulers", "_nested")}
        for key in ("_schedulers", "_nested"):
            held = self.__dict__.get(key)
            if isinstance(held, list):
                state[key] = [s.state_dict() if isinstance(s, LRScheduler) else None for s in held]
            elif isinstance(held, LRScheduler):
                state[key] = held.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, value in state_dict.items():
            held = self.__dict__.get(key)
            if key == "_schedulers" and isinstance(held, list):
                for scheduler, state in zip(held, value):
                    if isinstance(scheduler, LRScheduler) and state is not None:
                        scheduler.load_state_dict(state)
            elif key == "_nested" and isinstance(held, LRScheduler):
                held.load_state_dict(value)
            else:
                self.__dict__[key] = value
        self.last_epoch = int(self.last_epoch)


def _tag_set(tags: Any) -> set | None:
    if tags is None:
        return None
    return set(tags) if isinstance(tags, (list, tuple, set)) else {tags}


class ConstantLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, learning_rate: float, total_iters: int | None = None,
                 param_group_tags: Tags = None) -> None:
        self.learning_rate = learning_rate
        super().__init__(optimizer, total_iters, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        return _f32(self.learning_rate)


class PolynomialLR(LRScheduler):
    """From ``initial_learning_rate`` to ``end_learning_rate`` over ``total_iters`` as
    ``(1 - t/T) ** power``, then the end value (``cycle`` changes nothing within T, as in cstorch)."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, end_learning_rate: float,
                 total_iters: int, power: float = 1.0, cycle: bool = False, param_group_tags: Tags = None) -> None:
        self.initial_learning_rate, self.end_learning_rate = initial_learning_rate, end_learning_rate
        self.power, self.cycle = power, cycle
        super().__init__(optimizer, total_iters, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        # as cstorch: past total_iters the end value holds, ``cycle`` or not
        if float(epoch) >= self.total_iters:
            return _f32(self.end_learning_rate)
        span = float(self.total_iters) * (math.ceil((float(epoch) + 1) / self.total_iters) if self.cycle else 1)
        fraction = (1 - epoch / span) ** self.power
        return _f32(fraction * (self.initial_learning_rate - self.end_learning_rate) + self.end_learning_rate)


class LinearLR(PolynomialLR):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, end_learning_rate: float,
                 total_iters: int, cycle: bool = False, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, initial_learning_rate, end_learning_rate, total_iters, 1.0, cycle, param_group_tags)


class ExponentialLR(LRScheduler):
    """``initial * decay_rate ** (t / total_iters)`` (floored exponent with ``staircase``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, total_iters: int,
                 decay_rate: float, staircase: bool = False, param_group_tags: Tags = None) -> None:
        self.initial_learning_rate, self.decay_rate, self.staircase = float(initial_learning_rate), decay_rate, staircase
        super().__init__(optimizer, total_iters, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        power = epoch / self.total_iters
        return torch.pow(_f32(self.decay_rate), power.floor() if self.staircase else power) * self.initial_learning_rate


class InverseExponentialTimeDecayLR(LRScheduler):
    """``initial / (1 + decay_rate * t ** step_exponent / total_iters)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, step_exponent: int,
                 total_iters: int, decay_rate: float, staircase: bool = False, param_group_tags: Tags = None) -> None:
        self.initial_learning_rate, self.step_exponent = initial_learning_rate, step_exponent
        self.decay_rate, self.staircase = decay_rate, staircase
        super().__init__(optimizer, total_iters, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        alpha = torch.pow(epoch, self.step_exponent) / self.total_iters
        alpha = alpha.floor() if self.staircase else alpha
        return _f32(self.initial_learning_rate) / (alpha * self.decay_rate + 1.0)


class InverseSquareRootDecayLR(LRScheduler):
    """``initial * scale / sqrt(max(warmup_steps, t))``."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float = 1.0, scale: float = 1.0,
                 warmup_steps: int = 1, param_group_tags: Tags = None) -> None:
        self.initial_learning_rate, self.scale, self.warmup_steps = initial_learning_rate, scale, warmup_steps
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        return _f32(self.scale) / torch.sqrt(torch.maximum(_f32(self.warmup_steps), epoch)) * self.initial_learning_rate


class CosineDecayLR(LRScheduler):
    """Half a cosine from ``initial`` to ``end`` over ``total_iters``, then ``end``."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, end_learning_rate: float,
                 total_iters: int, param_group_tags: Tags = None) -> None:
        self.initial_learning_rate, self.end_learning_rate = initial_learning_rate, end_learning_rate
        super().__init__(optimizer, total_iters, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        progress = (torch.minimum(_f32(self.total_iters), epoch) * (math.pi / self.total_iters)).cos().add(1).mul(0.5)
        return progress * (self.initial_learning_rate - self.end_learning_rate) + self.end_learning_rate


class MultiStepLR(LRScheduler):
    """``initial * gamma ** (milestones passed)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, gamma: float,
                 milestones: Sequence[int], param_group_tags: Tags = None) -> None:
        self.initial_learning_rate, self.gamma, self.milestones = initial_learning_rate, gamma, list(milestones)
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        value = _f32(self.initial_learning_rate)
        for milestone in self.milestones:
            value = torch.where(epoch < milestone, value, _f32(self.gamma) * value)
        return value


class StepLR(LRScheduler):
    """``initial * gamma ** floor(t / step_size)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, step_size: int, gamma: float,
                 param_group_tags: Tags = None) -> None:
        self.initial_learning_rate, self.step_size, self.gamma = float(initial_learning_rate), step_size, gamma
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        return torch.pow(_f32(self.gamma), (epoch / self.step_size).floor()) * self.initial_learning_rate


class CosineAnnealingLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, T_max: int,  # noqa: N803
                 eta_min: float = 0.0, param_group_tags: Tags = None) -> None:
        self.initial_learning_rate, self.T_max, self.eta_min = float(initial_learning_rate), float(T_max), eta_min
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        factor = ((epoch / self.T_max) * math.pi).cos().add(1) / 2
        return factor * (self.initial_learning_rate - self.eta_min) + self.eta_min


class LambdaLR(LRScheduler):
    """cstorch's fixed lambda pair: ``initial**2 * (t / 30) * 0.95 ** t``."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, param_group_tags: Tags = None) -> None:
        self.initial_learning_rate = initial_learning_rate
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        initial = _f32(self.initial_learning_rate)
        return (initial * (epoch / 30)) * (initial * torch.pow(_f32(0.95), epoch))


class CosineAnnealingWarmRestarts(LRScheduler):
    """A cosine from ``initial`` to ``eta_min`` over the first ``T_0`` steps (``T_mult`` 1)."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, T_0: int,  # noqa: N803
                 T_mult: int = 1, eta_min: float = 0.0, param_group_tags: Tags = None) -> None:  # noqa: N803
        if T_mult != 1:
            raise ValueError("CosineAnnealingWarmRestarts supports only T_mult=1, as cstorch")
        self.initial_learning_rate, self.T_0, self.T_mult, self.eta_min = float(initial_learning_rate), T_0, T_mult, eta_min
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        # cstorch's formula after the first period: T_0 * (floor(t / T_0) - 1), so each later
        # period holds one value of the cosine (reproduced as the reference computes it)
        since_restart = epoch if float(epoch) < self.T_0 else (epoch / self.T_0).floor() * self.T_0 - self.T_0
        factor = ((since_restart / self.T_0) * math.pi).cos().add(1) / 2
        return factor * (self.initial_learning_rate - self.eta_min) + self.eta_min


class MultiplicativeLR(LRScheduler):
    """``initial * coefficient ** t``."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, coefficient: float,
                 param_group_tags: Tags = None) -> None:
        self.initial_learning_rate, self.coefficient = initial_learning_rate, coefficient
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        return torch.pow(_f32(self.coefficient), epoch) * self.initial_learning_rate


class CyclicLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, base_lr: float, max_lr: float, step_size_up: int = 2000,
                 step_size_down: int | None = None, mode: str = "triangular", gamma: float = 1.0,
                 scale_mode: str = "cycle", param_group_tags: Tags = None) -> None:
        if mode not in ("triangular", "triangular2", "exp_range"):
            raise ValueError(f"CyclicLR mode must be triangular, triangular2 or exp_range, got {mode!r}")
        self.base_lr, self.max_lr, self.mode, self.gamma = base_lr, max_lr, mode, gamma
        self.step_size_up = step_size_up
        self.step_size_down = step_size_up if step_size_down is None else step_size_down
        self.scale_mode = "iterations" if mode == "exp_range" else "cycle"
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        total = self.step_size_up + self.step_size_down
        up_ratio = self.step_size_up / total
        cycle = torch.floor(epoch / total + 1)
        x = epoch / total - cycle + 1
        height = torch.where(x <= up_ratio, x / up_ratio, (x - 1) / (up_ratio - 1)) * (self.max_lr - self.base_lr)
        scale: Any = 1.0
        if self.mode == "triangular2":
            scale = 1 / torch.pow(_f32(2), cycle - 1)
        elif self.mode == "exp_range":
            scale = torch.pow(_f32(self.gamma), epoch)
        return height * scale + self.base_lr


class OneCycleLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, max_lr: float,
                 total_steps: int = 1000, pct_start: float = 0.3, final_div_factor: float = 1e4,
                 three_phase: bool = False, anneal_strategy: str = "cos", param_group_tags: Tags = None) -> None:
        self.initial_learning_rate, self.max_lr, self.total_steps = initial_learning_rate, max_lr, total_steps
        self.pct_start, self.final_div_factor = pct_start, final_div_factor
        self.three_phase, self.anneal_strategy = three_phase, anneal_strategy
        super().__init__(optimizer, None, param_group_tags)

    def _anneal(self, start: float, end: float, pct: torch.Tensor) -> torch.Tensor:
        if self.anneal_strategy == "cos":
            return (pct * math.pi).cos().add(1) * ((start - end) / 2.0) + end
        return pct * (end - start) + start

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        low, peak, final = self.initial_learning_rate, self.max_lr, self.initial_learning_rate / self.final_div_factor
        warm = self.pct_start * self.total_steps - 1
        if self.three_phase:
            ends, starts, targets = [warm, 2 * self.pct_start * self.total_steps - 2, self.total_steps - 1], [low, peak, low], [peak, low, final]
        else:
            ends, starts, targets = [warm, self.total_steps - 1], [low, peak], [peak, final]
        value = self._anneal(starts[0], targets[0], epoch / ends[0])
        for index in range(1, len(ends)):
            pct = (epoch - ends[index - 1]) / (ends[index] - ends[index - 1])
            value = torch.where(epoch > ends[index - 1], self._anneal(starts[index], targets[index], pct), value)
        return value


class SequentialLR(LRScheduler):
    """``schedulers[i]`` from ``milestones[i-1]`` on, each counting from its own start."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedulers: Sequence[LRScheduler], milestones: Sequence[int],
                 last_epoch: int = -1, param_group_tags: Tags = None) -> None:
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(f"SequentialLR needs one milestone fewer than schedulers, got {len(schedulers)} "
                             f"schedulers and {len(milestones)} milestones")
        if any(s.optimizer is not optimizer for s in schedulers):
            raise ValueError("SequentialLR: every scheduler must belong to the same optimizer")
        self._schedulers, self.milestones = list(schedulers), [int(m) for m in milestones]
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        index = sum(1 for m in self.milestones if float(epoch) >= m)
        start = self.milestones[index - 1] if index else 0
        return torch.as_tensor(self._schedulers[index]._value(epoch - start), dtype=torch.float32)


class PiecewiseConstantLR(SequentialLR):
    """``learning_rates[i]`` until ``milestones[i]``, the last one after."""

    def __init__(self, optimizer: torch.optim.Optimizer, learning_rates: Sequence[float], milestones: Sequence[int],
                 param_group_tags: Tags = None) -> None:
        if len(learning_rates) != len(milestones) + 1:
            raise ValueError("PiecewiseConstantLR needs one learning rate more than milestones")
        constants = [_Constant(value) for value in learning_rates]
        self._schedulers, self.milestones = constants, [int(m) for m in milestones]
        LRScheduler.__init__(self, optimizer, None, param_group_tags)


class _Constant:
    def __init__(self, value: float) -> None:
        self.value = value

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        return _f32(self.value)


class ChainedLR(LRScheduler):
    """The first scheduler's value times each other's value over its initial value."""

    def __init__(self, schedulers: Sequence[LRScheduler], param_group_tags: Tags = None) -> None:
        self._schedulers = list(schedulers)
        if not self._schedulers:
            raise ValueError("ChainedLR needs at least one scheduler")
        super().__init__(self._schedulers[0].optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        value = self._schedulers[0]._value(epoch)
        for scheduler in self._schedulers[1:]:
            value = value * (scheduler._value(epoch) / scheduler.initial_learning_rate)
        return value


ChainedScheduler = ChainedLR


class ScalePerParamLR(LRScheduler):
    """``scheduler``'s value times each param group's ``adjust_learning_rate`` (default 1)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: LRScheduler, param_group_tags: Tags = None) -> None:
        self._nested = scheduler
        self.adjustment_scalars = [g.get("adjust_learning_rate", g.get("adjust_val", 1.0)) for g in optimizer.param_groups]
        super().__init__(optimizer, None, param_group_tags)

    def get(self) -> list[Any]:
        value = float(self._nested._value(torch.tensor(float(self.last_epoch))))
        return [value * scale if self._applies_to(g) else None
                for g, scale in zip(self.optimizer.param_groups, self.adjustment_scalars)]
