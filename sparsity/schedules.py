"""Hyper-parameter schedules (sparsity, drop fraction): one implementation of each, shared by
the YAML path (``sparsity.configure``) and ``sparsity.cstorch`` (whose
``HyperParameterSchedule`` adds cstorch's memo and update protocol on top of these classes).

The schedules cstorch 2.10 defines (``constant``, ``linear``, ``exp``, ``power``, ``cosine``,
``cycling``, ``lambda``) follow its formulas, written once in torch ops on a 0-d step tensor:
the YAML path evaluates them in float64 (``value_at``), ``sparsity.cstorch`` in cstorch's
float32 (``compute`` on its int64 step), so each gets the reference's arithmetic at its own
precision (docs/cstorch.md, "Schedules"). ``polynomial``/``cubic``, ``piecewiseconstant`` and
``periodic`` are the engine's own.

A schedule is a function of the step (a cycling schedule counts the mask updates of the
cadence its algorithm binds), so it has no state to checkpoint. Subclasses register by their
``TYPE`` if they set one, else by lowercase class name with any trailing "schedule" removed
(``CosineSchedule`` → ``"cosine"``), so ``{"type": "mydecay", ...}`` finds a user's
``MyDecay(Schedule)``. A user class never replaces a built-in name (a warning says so; pass an
instance of it instead).

Three ways to write one: subclass :class:`Schedule` with ``compute(step)`` on tensors (as
the built-ins), or with ``__call__(step: int) -> float``; or cstorch 2.0's protocol,
:class:`BaseHyperParameter`, with ``__call__(step, is_update_step)`` on tensors (the blog's
classes drop in unchanged). All answer ``get_min_max_end(begin, end)``.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from .update_schedules import (AtSteps, Never, Periodic, UpdateSchedule, UpdateWhen,
                               make_update_schedule)

__all__ = [
    "Schedule", "BaseHyperParameter", "Constant", "Linear", "Exp", "Power", "Cosine", "Cycling",
    "Lambda", "Cubic", "Polynomial", "PiecewiseConstant", "PeriodicSchedule", "make_schedule",
    "schedule_names", "step_tensor", "UpdateSchedule", "Periodic", "AtSteps", "UpdateWhen", "Never",
    "make_update_schedule",
]


def _registry_key(cls_name: str) -> str:
    name = cls_name.lower()
    return name[: -len("schedule")] if name.endswith("schedule") and name != "schedule" else name


def step_tensor(step: Any) -> torch.Tensor:
    """``step`` as the formulas take it: a tensor as is, a number as a float32 tensor (cstorch's
    conversion)."""
    return step if isinstance(step, torch.Tensor) else torch.tensor(step, dtype=torch.float)


def _value(number: Any, step: torch.Tensor) -> torch.Tensor:
    """A schedule's parameter as a 0-d tensor: float64 when the step is float64 (the YAML
    path), else as ``torch.tensor`` makes it (cstorch's float32 for a float, int64 for an int)."""
    return torch.tensor(number, dtype=torch.float64) if step.dtype == torch.float64 else torch.tensor(number)


class Schedule(ABC):
    """A value as a function of the step. Subclasses implement ``compute(step)`` or
    ``__call__(step) -> float``."""

    registry: ClassVar[dict[str, type[Schedule]]] = {}
    registered: ClassVar[bool] = True  # protocol bases set False: not a schedule name
    config_names: ClassVar[bool] = True  # False for a family named by its own lookup (cstorch's)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("registered", True) or not cls.config_names:
            return
        name = str(cls.__dict__.get("TYPE") or _registry_key(cls.__name__)).lower()
        built_in = Schedule.registry.get(name)
        if built_in is not None and built_in.__module__ == __name__ and cls.__module__ != __name__:
            warnings.warn(f"schedule type {name!r} is built in, so {cls.__qualname__} is not "
                          f"registered under it; pass an instance of it, or give it another TYPE",
                          stacklevel=2)
            return
        Schedule.registry[name] = cls

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        """The value at ``step`` (a 0-d tensor) as a 0-d tensor, at the step's precision. The
        default asks ``__call__(int(step))``, for schedules written that way."""
        if type(self).__call__ is Schedule.__call__:
            raise TypeError(f"{type(self).__name__} defines neither compute(step) nor __call__(step)")
        return _value(float(self(int(step))), step)

    def __call__(self, step: int, is_update_step: bool = False) -> float:
        return self.value_at(step, is_update_step)

    def value_at(self, step: int, is_update_step: bool = False) -> float:
        """The value at optimizer step ``step`` as a float, in float64 (what the algorithms read)."""
        return float(self.compute(torch.tensor(step, dtype=torch.float64)))

    def __getitem__(self, param: Any) -> Schedule:
        """cstorch algorithms read ``self.sparsity[param]``, a schedule per parameter; ours is
        one schedule for all (a distribution spreads its level over the layers)."""
        return self

    def get_min_max_end(self, begin: int, end: int) -> tuple[float, float, float]:
        """(minimum, maximum, value at ``end``) over the steps ``begin..end``, as cstorch's
        hyper-parameters answer it; found by evaluating every step, so exact for any shape."""
        if end < begin:
            raise ValueError(f"end ({end}) must not be before begin ({begin})")
        values = [self.value_at(step) for step in range(begin, end + 1)]
        return min(values), max(values), values[-1]

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


# ------------------------------------------------------- the schedules cstorch 2.10 defines
class Constant(Schedule):
    """The same ``value`` at every step (what a number as ``sparsity`` becomes)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        return _value(self.value, step_tensor(step))


class Linear(Schedule):
    """``init + step * slope``."""

    def __init__(self, init: float, slope: float) -> None:
        super().__init__()
        self.init, self.slope = init, slope

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        step = step_tensor(step)
        return _value(self.init, step) + step * _value(self.slope, step)


class Exp(Schedule):
    """``final - (final - init) * exp(gamma * step)``: from ``init`` towards ``final`` for a
    negative ``gamma`` (cstorch's formula; its docstring writes the sign the other way)."""

    def __init__(self, init: float, gamma: float, final: float = 1.0) -> None:
        super().__init__()
        self.init, self.gamma, self.final = init, gamma, final

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        step = step_tensor(step)
        final = _value(self.final, step)
        return final - (final - _value(self.init, step)) * torch.exp(step * _value(self.gamma, step))


class Power(Schedule):
    """``init * beta ** step``."""

    def __init__(self, init: float, beta: float) -> None:
        super().__init__()
        self.init, self.beta = init, beta

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        step = step_tensor(step)
        return _value(self.init, step) * torch.pow(_value(self.beta, step), step)


class Cosine(Schedule):
    """``offset + amplitude * cos(pi * step / half_period)``, offset ``(init + minimum) / 2``:
    from ``init`` down to ``minimum`` at ``half_period`` and back up to ``init`` at twice that
    (RigL's drop fraction with ``half_period = T_end`` and updates ending there)."""

    def __init__(self, init: float, half_period: float, minimum: float = 0.0) -> None:
        super().__init__()
        if half_period <= 0:
            raise ValueError(f"half_period must be > 0, got {half_period}")
        self.init, self.half_period, self.minimum = init, half_period, minimum

    def terms(self, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(amplitude, angular frequency, offset) at ``step``'s precision."""
        offset = (self.minimum + self.init) / 2
        return (_value(self.init - offset, step), _value(math.pi / self.half_period, step),
                _value(offset, step))

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        step = step_tensor(step)
        amplitude, frequency, offset = self.terms(step)
        return amplitude * torch.cos(step * frequency) + offset


class Cycling(Schedule):
    """``values[i]``, ``i`` moving on (wrapping) at each mask update. The engine's algorithms
    bind their cadence (:meth:`count_updates`), so the value is a function of the step: the
    number of update steps before it, from step 0 for a sparsity (cstorch counts the initial
    mask when the cadence includes step 0) and from step 1 for a drop fraction. Unbound, ``i``
    is the ``index`` that cstorch's protocol advances with :meth:`update` (and saves)."""

    def __init__(self, values: Sequence[float]) -> None:
        super().__init__()
        if not values:
            raise ValueError("a cycling schedule needs at least one value")
        self.values = list(values)
        self.index = torch.tensor(0, dtype=torch.int64)
        self._count: tuple[UpdateSchedule, int] | None = None
        self._counted = (0, 0)  # (t, updates in [first, t)): a callable cadence is counted on from there

    def count_updates(self, cadence: UpdateSchedule, first: int) -> None:
        """Makes the position at step t the number of ``cadence``'s update steps in [first, t)."""
        self._count, self._counted = (cadence, first), (first, 0)

    @property
    def bound(self) -> bool:
        """Whether a cadence gives the position (else ``index`` does)."""
        return self._count is not None

    def position(self, step: int) -> int:
        if self._count is None:
            return int(self.index) % len(self.values)
        cadence, first = self._count
        since, counted = self._counted if step >= self._counted[0] else (first, 0)
        self._counted = (max(step, since), counted + cadence.count(since, step))
        return self._counted[1] % len(self.values)

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        step = step_tensor(step)
        return _value(self.values, step)[self.position(int(step))]  # the list's common dtype, as cstorch

    def update(self, is_update_step: Any) -> None:
        """cstorch's protocol: moves ``index`` on when ``is_update_step`` (a 0-d bool tensor)."""
        following = (self.index + 1) % len(self.values)
        self.index = torch.where(torch.as_tensor(is_update_step, dtype=torch.bool), following, self.index)

    def visit_state(self, fn: Callable[[torch.Tensor], Any]) -> None:
        moved = fn(self.index)
        if moved is not None:
            self.index = moved

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = torch.as_tensor(state["index"], dtype=torch.int64)


class Lambda(Schedule):
    """``fn(step)``: cstorch passes its step tensor; the YAML path a plain int, so a plain
    Python function of the step works (reference quirk 4, docs/design.md)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        super().__init__()
        if not callable(fn):
            raise ValueError(f"a lambda schedule needs a callable, got {type(fn).__name__}")
        self.fn = fn

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        return self.fn(step)

    def value_at(self, step: int, is_update_step: bool = False) -> float:
        return float(self.fn(step))


# ------------------------------------------------------------------- the engine's own
class Polynomial(Schedule):
    """``final + (init - final) * (1 - p) ** power``, p the progress from ``begin_step`` to
    ``end_step`` counted in pruning periods of ``every`` steps (the periods step t,
    ``begin_step`` and ``end_step`` fall in, as the cstorch blog's cubic counts them), clamped
    to [0, 1]. With start 150, end 1150 and every 100, step 200 is one period of ten in."""

    def __init__(
        self, init: float, final: float, begin_step: int, end_step: int, power: float = 3.0, every: int = 1
    ) -> None:
        super().__init__()
        if end_step <= begin_step:
            raise ValueError(f"end_step ({end_step}) must be after begin_step ({begin_step})")
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.init, self.final, self.power = float(init), float(final), float(power)
        self.begin_step, self.end_step, self.every = int(begin_step), int(end_step), int(every)

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        first = self.begin_step // self.every
        periods = max(1, self.end_step // self.every - first)
        progress = min(1.0, max(0, int(step) // self.every - first) / periods)
        return _value(self.final + (self.init - self.final) * (1.0 - progress) ** self.power, step)


class Cubic(Polynomial):
    """Zhu & Gupta gradual pruning: ``s_t = s_f + (s_i - s_f)(1 - (t - t0)/(n Δt))^3``.

    Arguments carry the seed blog's names; ``s_t`` only changes every ``prune_every_k_steps``.
    """

    def __init__(
        self,
        init_sparsity: float,
        end_sparsity: float,
        sparsity_start_step: int,
        sparsity_end_step: int,
        prune_every_k_steps: int = 1,
    ) -> None:
        super().__init__(
            init_sparsity, end_sparsity, sparsity_start_step, sparsity_end_step, 3.0, prune_every_k_steps
        )


class PiecewiseConstant(Schedule):
    """Legacy ``sparsity_schedule: [[step, value], ...]``: the value of the last boundary ≤ t."""

    def __init__(self, points: Sequence[Sequence[float]]) -> None:
        super().__init__()
        if not points or any(len(p) != 2 for p in points):
            raise ValueError("sparsity_schedule must be a non-empty list of [step, value] pairs")
        self.points = sorted((int(s), float(v)) for s, v in points)

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        value = self.points[0][1]
        for boundary, v in self.points:
            if int(step) >= boundary:
                value = v
        return _value(value, step)


class PeriodicSchedule(Schedule):
    """Another schedule repeated every ``period`` steps: ``schedule(t mod period)``, e.g. a drop
    fraction that decays by cosine and restarts every 1000 steps. ``schedule`` is anything
    ``make_schedule`` takes."""

    def __init__(self, schedule: Any, period: int) -> None:
        super().__init__()
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"period must be an int >= 1, got {period!r}")
        self.schedule, self.period = make_schedule(schedule), period

    def value_at(self, step: int, is_update_step: bool = False) -> float:
        return self.schedule.value_at(int(step) % self.period, is_update_step)

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        return _value(self.value_at(int(step)), step)


class BaseHyperParameter(Schedule):
    """cstorch 2.0's hyper-parameter protocol: ``__call__(step, is_update_step)`` receives a
    0-d int64 tensor and a 0-d bool tensor and returns a tensor (or number); ``TYPE`` is its
    name in configs. Subclass it to drop a class written for cstorch 2.0's ``cstorch.sparse``
    in unchanged (2.10's ``HyperParameterSchedule`` is in ``sparsity.cstorch.sparse.utils``)."""

    registered = False

    @abstractmethod
    def __call__(self, step: torch.Tensor, is_update_step: torch.Tensor) -> torch.Tensor: ...

    def value_at(self, step: int, is_update_step: bool = False) -> float:
        """The value at optimizer step ``step``: the cstorch call on tensors, as a float."""
        return float(self(torch.tensor(int(step)), torch.tensor(bool(is_update_step))))


def schedule_names() -> list[str]:
    """The registered schedule types a ``{"type": ...}`` config may name, sorted."""
    return sorted(Schedule.registry)


def make_schedule(value: Any, *, cadence: UpdateSchedule | None = None, first: int = 0) -> Schedule:
    """Builds a schedule from a float, a ``{"type": ...}`` dict, a list (cycling), a plain
    callable, or a :class:`Schedule` (returned as is). A cycling schedule not bound yet counts
    the updates of ``cadence`` from step ``first`` (see :class:`Cycling`)."""
    schedule = _schedule_of(value)
    if cadence is not None and isinstance(schedule, Cycling) and not schedule.bound:
        schedule.count_updates(cadence, first)
    return schedule


def _schedule_of(value: Any) -> Schedule:
    if isinstance(value, Schedule):
        return value
    if isinstance(value, bool):
        raise ValueError(f"a schedule value must be a number, dict, list or callable, got {value!r}")
    if isinstance(value, (int, float)):
        return Constant(value)
    if isinstance(value, (list, tuple)):
        return Cycling(value)
    if isinstance(value, dict):
        spec = dict(value)
        kind = spec.pop("type", None)
        if kind is None:
            raise ValueError(f"schedule dict needs a 'type' (one of {schedule_names()}), got {value!r}")
        cls = Schedule.registry.get(str(kind).lower())
        if cls is None:
            raise ValueError(
                f"unknown schedule type {kind!r}; known: {schedule_names()}. "
                "Register one by subclassing sparsity.schedules.Schedule."
            )
        try:
            return cls(**spec)
        except TypeError as err:
            raise ValueError(f"bad arguments for schedule {kind!r}: {err}") from None
    if callable(value):
        return Lambda(value)
    raise ValueError(f"cannot make a schedule from {type(value).__name__} {value!r}")
