"""``cstorch.optim.scheduler``: cstorch's schedulers of any param-group value, written once;
``lr_scheduler`` and ``weight_decay_scheduler`` name them for ``"lr"`` and ``"weight_decay"``,
and a subclass naming another key (``param_group_key = "momentum"``) schedules that.

Each is a closed form of ``last_epoch`` (the number of ``step()`` calls), in float32 as
cstorch computes it: building one sets the value to its value at 0, each ``step()`` to the value
at the next epoch. A step that the GradScaler skipped (non-finite gradients) does not move
``last_epoch``, so the schedule stays in step with the sparsity ``step`` (the reference rolls
``last_epoch`` back but keeps the value it wrote: docs/cstorch.md). ``param_group_tags``
restricts a scheduler to the param groups whose ``tags`` share one.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "Scheduler", "ConstantScheduler", "PolynomialScheduler", "LinearScheduler", "ExponentialScheduler",
    "InverseExponentialTimeDecayScheduler", "InverseSquareRootDecayScheduler", "CosineDecayScheduler",
    "SequentialScheduler", "PiecewiseConstantScheduler", "MultiStepScheduler", "StepScheduler",
    "CosineAnnealingScheduler", "LambdaScheduler", "CosineAnnealingWarmRestartsScheduler",
    "MultiplicativeScheduler", "ChainedScheduler", "CyclicScheduler", "OneCycleScheduler", "ScalePerParamScheduler",
]

Tags = str | Sequence[str | None] | None


def _f32(value: Any) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32)


def _tag_set(tags: Any) -> set | None:
    if tags is None:
        return None
    return set(tags) if isinstance(tags, (list, tuple, set)) else {tags}


class Scheduler(ABC):
    """Base: subclasses give ``_value(epoch) -> 0-d tensor`` and name ``param_group_key``."""

    @property
    @abstractmethod
    def param_group_key(self) -> str:
        """The param-group entry this scheduler sets (``"lr"``, ``"weight_decay"``, ...)."""

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
    @abstractmethod
    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        """The value at ``epoch`` (a float 0-d tensor)."""

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

    # --------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Plain values; schedulers held inside (Sequential, Chained, ScalePerParam) as their
        own state dicts."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_schedulers", "_nested")}
        for key in ("_schedulers", "_nested"):
            held = self.__dict__.get(key)
            if isinstance(held, list):
                state[key] = [s.state_dict() for s in held]
            elif isinstance(held, Scheduler):
                state[key] = held.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, value in state_dict.items():
            held = self.__dict__.get(key)
            if key == "_schedulers" and isinstance(held, list):
                for scheduler, state in zip(held, value):
                    scheduler.load_state_dict(state)
            elif key == "_nested" and isinstance(held, Scheduler):
                held.load_state_dict(value)
            else:
                self.__dict__[key] = value
        self.last_epoch = int(self.last_epoch)


# ---------------------------------------------------------------------- closed forms
class ConstantScheduler(Scheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, val: float, total_iters: int | None = None,
                 param_group_tags: Tags = None) -> None:
        self.val = val
        super().__init__(optimizer, total_iters, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        return _f32(self.val)


class PolynomialScheduler(Scheduler):
    """From ``initial_val`` to ``end_val`` over ``total_iters`` as ``(1 - t/T) ** power``, then
    the end value (``cycle`` changes nothing within T, as in cstorch)."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_val: float, end_val: float, total_iters: int,
                 power: float = 1.0, cycle: bool = False, param_group_tags: Tags = None) -> None:
        self.initial_val, self.end_val, self.power, self.cycle = initial_val, end_val, power, cycle
        super().__init__(optimizer, total_iters, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        # as cstorch: past total_iters the end value holds, ``cycle`` or not
        if float(epoch) >= self.total_iters:
            return _f32(self.end_val)
        span = float(self.total_iters) * (math.ceil((float(epoch) + 1) / self.total_iters) if self.cycle else 1)
        fraction = (1 - epoch / span) ** self.power
        return _f32(fraction * (self.initial_val - self.end_val) + self.end_val)


class LinearScheduler(PolynomialScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_val: float, end_val: float, total_iters: int,
                 cycle: bool = False, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, initial_val, end_val, total_iters, 1.0, cycle, param_group_tags)


class ExponentialScheduler(Scheduler):
    """``initial * decay_rate ** (t / total_iters)`` (floored exponent with ``staircase``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_val: float, total_iters: int, decay_rate: float,
                 staircase: bool = False, param_group_tags: Tags = None) -> None:
        self.initial_val, self.decay_rate, self.staircase = float(initial_val), decay_rate, staircase
        super().__init__(optimizer, total_iters, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        power = epoch / self.total_iters
        return torch.pow(_f32(self.decay_rate), power.floor() if self.staircase else power) * self.initial_val


class InverseExponentialTimeDecayScheduler(Scheduler):
    """``initial / (1 + decay_rate * t ** step_exponent / total_iters)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_val: float, step_exponent: int, total_iters: int,
                 decay_rate: float, staircase: bool = False, param_group_tags: Tags = None) -> None:
        self.initial_val, self.step_exponent, self.decay_rate, self.staircase = (initial_val, step_exponent,
                                                                                 decay_rate, staircase)
        super().__init__(optimizer, total_iters, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        alpha = torch.pow(epoch, self.step_exponent) / self.total_iters
        alpha = alpha.floor() if self.staircase else alpha
        return _f32(self.initial_val) / (alpha * self.decay_rate + 1.0)


class InverseSquareRootDecayScheduler(Scheduler):
    """``initial * scale / sqrt(max(warmup_steps, t))``."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_val: float = 1.0, scale: float = 1.0,
                 warmup_steps: int = 1, param_group_tags: Tags = None) -> None:
        self.initial_val, self.scale, self.warmup_steps = initial_val, scale, warmup_steps
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        return _f32(self.scale) / torch.sqrt(torch.maximum(_f32(self.warmup_steps), epoch)) * self.initial_val


class CosineDecayScheduler(Scheduler):
    """Half a cosine from ``initial`` to ``end`` over ``total_iters``, then ``end``."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_val: float, end_val: float, total_iters: int,
                 param_group_tags: Tags = None) -> None:
        self.initial_val, self.end_val = initial_val, end_val
        super().__init__(optimizer, total_iters, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        progress = (torch.minimum(_f32(self.total_iters), epoch) * (math.pi / self.total_iters)).cos().add(1).mul(0.5)
        return progress * (self.initial_val - self.end_val) + self.end_val


class MultiStepScheduler(Scheduler):
    """``initial * gamma ** (milestones passed)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_val: float, gamma: float, milestones: Sequence[int],
                 param_group_tags: Tags = None) -> None:
        self.initial_val, self.gamma, self.milestones = initial_val, gamma, list(milestones)
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        value = _f32(self.initial_val)
        for milestone in self.milestones:
            value = torch.where(epoch < milestone, value, _f32(self.gamma) * value)
        return value


class StepScheduler(Scheduler):
    """``initial * gamma ** floor(t / step_size)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_val: float, step_size: int, gamma: float,
                 param_group_tags: Tags = None) -> None:
        self.initial_val, self.step_size, self.gamma = float(initial_val), step_size, gamma
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        return torch.pow(_f32(self.gamma), (epoch / self.step_size).floor()) * self.initial_val


class CosineAnnealingScheduler(Scheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_val: float, T_max: int,  # noqa: N803
                 eta_min: float = 0.0, param_group_tags: Tags = None) -> None:
        self.initial_val, self.T_max, self.eta_min = float(initial_val), float(T_max), eta_min
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        factor = ((epoch / self.T_max) * math.pi).cos().add(1) / 2
        return factor * (self.initial_val - self.eta_min) + self.eta_min


class LambdaScheduler(Scheduler):
    """The product of ``initial * f(t)`` over the functions ``set_value_lambda()`` returns
    (cstorch's pair by default: ``t / 30`` and ``0.95 ** t``); override it for others."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_val: float, param_group_tags: Tags = None) -> None:
        self.initial_val = initial_val
        super().__init__(optimizer, None, param_group_tags)

    def set_value_lambda(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        return [lambda epoch: epoch / 30, lambda epoch: torch.pow(_f32(0.95), epoch)]

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        value = _f32(1.0)
        for function in self.set_value_lambda():
            value = (_f32(self.initial_val) * function(epoch)) * value
        return value


class CosineAnnealingWarmRestartsScheduler(Scheduler):
    """A cosine from ``initial`` to ``eta_min`` over the first ``T_0`` steps (``T_mult`` 1)."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_val: float, T_0: int,  # noqa: N803
                 T_mult: int = 1, eta_min: float = 0.0, param_group_tags: Tags = None) -> None:  # noqa: N803
        if T_mult != 1:
            raise ValueError(f"{type(self).__name__} supports only T_mult=1, as cstorch")
        self.initial_val, self.T_0, self.T_mult, self.eta_min = float(initial_val), T_0, T_mult, eta_min
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        # cstorch's formula after the first period: T_0 * (floor(t / T_0) - 1), so each later
        # period holds one value of the cosine (reproduced as the reference computes it)
        since_restart = epoch if float(epoch) < self.T_0 else (epoch / self.T_0).floor() * self.T_0 - self.T_0
        factor = ((since_restart / self.T_0) * math.pi).cos().add(1) / 2
        return factor * (self.initial_val - self.eta_min) + self.eta_min


class MultiplicativeScheduler(Scheduler):
    """``initial * coefficient ** t``."""

    def __init__(self, optimizer: torch.optim.Optimizer, initial_val: float, coefficient: float,
                 param_group_tags: Tags = None) -> None:
        self.initial_val, self.coefficient = initial_val, coefficient
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        return torch.pow(_f32(self.coefficient), epoch) * self.initial_val


class CyclicScheduler(Scheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, base_val: float, max_val: float, step_size_up: int = 2000,
                 step_size_down: int | None = None, mode: str = "triangular", gamma: float = 1.0,
                 scale_mode: str = "cycle", param_group_tags: Tags = None) -> None:
        if mode not in ("triangular", "triangular2", "exp_range"):
            raise ValueError(f"{type(self).__name__} mode must be triangular, triangular2 or exp_range, got {mode!r}")
        self.base_val, self.max_val, self.mode, self.gamma = base_val, max_val, mode, gamma
        self.step_size_up = step_size_up
        self.step_size_down = step_size_up if step_size_down is None else step_size_down
        self.scale_mode = "iterations" if mode == "exp_range" else "cycle"
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        total = self.step_size_up + self.step_size_down
        up_ratio = self.step_size_up / total
        cycle = torch.floor(epoch / total + 1)
        x = epoch / total - cycle + 1
        height = torch.where(x <= up_ratio, x / up_ratio, (x - 1) / (up_ratio - 1)) * (self.max_val - self.base_val)
        scale: Any = 1.0
        if self.mode == "triangular2":
            scale = 1 / torch.pow(_f32(2), cycle - 1)
        elif self.mode == "exp_range":
            scale = torch.pow(_f32(self.gamma), epoch)
        return height * scale + self.base_val


class OneCycleScheduler(Scheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_val: float, max_val: float, total_steps: int = 1000,
                 pct_start: float = 0.3, final_div_factor: float = 1e4, three_phase: bool = False,
                 anneal_strategy: str = "cos", param_group_tags: Tags = None) -> None:
        self.initial_val, self.max_val, self.total_steps = initial_val, max_val, total_steps
        self.pct_start, self.final_div_factor = pct_start, final_div_factor
        self.three_phase, self.anneal_strategy = three_phase, anneal_strategy
        super().__init__(optimizer, None, param_group_tags)

    def _anneal(self, start: float, end: float, pct: torch.Tensor) -> torch.Tensor:
        if self.anneal_strategy == "cos":
            return (pct * math.pi).cos().add(1) * ((start - end) / 2.0) + end
        return pct * (end - start) + start

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        low, peak, final = self.initial_val, self.max_val, self.initial_val / self.final_div_factor
        warm = self.pct_start * self.total_steps - 1
        if self.three_phase:
            ends, starts, targets = ([warm, 2 * self.pct_start * self.total_steps - 2, self.total_steps - 1],
                                     [low, peak, low], [peak, low, final])
        else:
            ends, starts, targets = [warm, self.total_steps - 1], [low, peak], [peak, final]
        value = self._anneal(starts[0], targets[0], epoch / ends[0])
        for index in range(1, len(ends)):
            pct = (epoch - ends[index - 1]) / (ends[index] - ends[index - 1])
            value = torch.where(epoch > ends[index - 1], self._anneal(starts[index], targets[index], pct), value)
        return value


# ------------------------------------------------------------ schedulers of schedulers
class SequentialScheduler(Scheduler):
    """``schedulers[i]`` from ``milestones[i-1]`` on, each counting from its own start."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedulers: Sequence[Scheduler], milestones: Sequence[int],
                 last_epoch: int = -1, param_group_tags: Tags = None) -> None:
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(f"{type(self).__name__} needs one milestone fewer than schedulers, got "
                             f"{len(schedulers)} schedulers and {len(milestones)} milestones")
        if any(s.optimizer is not optimizer for s in schedulers):
            raise ValueError(f"{type(self).__name__}: every scheduler must belong to the same optimizer")
        if any(s.param_group_key != self.param_group_key for s in schedulers):
            raise ValueError(f"{type(self).__name__}: every scheduler must set {self.param_group_key!r}")
        self._schedulers, self.milestones = list(schedulers), [int(m) for m in milestones]
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        index = sum(1 for m in self.milestones if float(epoch) >= m)
        start = self.milestones[index - 1] if index else 0
        return torch.as_tensor(self._schedulers[index]._value(epoch - start), dtype=torch.float32)


class PiecewiseConstantScheduler(SequentialScheduler):
    """``vals[i]`` until ``milestones[i]``, the last one after (each a ``constant_cls``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, constant_cls: type[Scheduler], vals: Sequence[float],
                 milestones: Sequence[int], param_group_tags: Tags = None) -> None:
        if len(vals) != len(milestones) + 1:
            raise ValueError(f"{type(self).__name__} needs one value more than milestones")
        super().__init__(optimizer, [constant_cls(optimizer, val) for val in vals], milestones,
                         param_group_tags=param_group_tags)


class ChainedScheduler(Scheduler):
    """The first scheduler's value times each other's value over its initial value."""

    def __init__(self, schedulers: Sequence[Scheduler], param_group_tags: Tags = None) -> None:
        self._schedulers = list(schedulers)
        if not self._schedulers:
            raise ValueError(f"{type(self).__name__} needs at least one scheduler")
        super().__init__(self._schedulers[0].optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        value = self._schedulers[0]._value(epoch)
        for scheduler in self._schedulers[1:]:
            value = value * (scheduler._value(epoch) / scheduler.initial_val)
        return value


class ScalePerParamScheduler(Scheduler):
    """``scheduler``'s value times each param group's ``adjust_learning_rate`` (or
    ``adjust_val``; default 1)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Scheduler, param_group_tags: Tags = None) -> None:
        self._nested = scheduler
        self.adjustment_scalars = [g.get("adjust_learning_rate", g.get("adjust_val", 1.0)) for g in optimizer.param_groups]
        super().__init__(optimizer, None, param_group_tags)

    def _value(self, epoch: torch.Tensor) -> torch.Tensor:
        return self._nested._value(epoch)

    def get(self) -> list[Any]:
        value = float(self._value(torch.tensor(float(self.last_epoch))))
        return [value * scale if self._applies_to(g) else None
                for g, scale in zip(self.optimizer.param_groups, self.adjustment_scalars)]
