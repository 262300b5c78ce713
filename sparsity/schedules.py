"""Hyper-parameter schedules (sparsity, drop fraction) and update cadences.

A :class:`Schedule` is a pure function of the optimizer step, so it has no state to checkpoint and
a step-varying drop fraction really varies (the reference caches its step-1 value). Subclasses
register by their ``TYPE`` if they set one, else by lowercase class name with any trailing
"schedule" removed (``CosineSchedule`` → ``"cosine"``), so ``{"type": "mydecay", ...}`` finds a
user's ``MyDecay(Schedule)``. A user class never replaces a built-in name (a warning says so;
pass an instance of it instead).

Two ways to write one: subclass :class:`Schedule` with ``__call__(step: int) -> float``, or
cstorch 2.0's protocol, :class:`BaseHyperParameter`, with ``__call__(step, is_update_step)`` on
tensors (the blog's classes drop in unchanged). Both answer ``get_min_max_end(begin, end)``.

An :class:`UpdateSchedule` answers "is step t a mask-update step?" (t counts optimizer steps, 1-based).
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

__all__ = [
    "Schedule",
    "BaseHyperParameter",
    "Constant",
    "Linear",
    "Exp",
    "Power",
    "Cosine",
    "Cycling",
    "Lambda",
    "Cubic",
    "Polynomial",
    "PiecewiseConstant",
    "PeriodicSchedule",
    "make_schedule",
    "schedule_names",
    "UpdateSchedule",
    "Periodic",
    "AtSteps",
    "UpdateWhen",
    "make_update_schedule",
]


def _registry_key(cls_name: str) -> str:
    name = cls_name.lower()
    return name[: -len("schedule")] if name.endswith("schedule") and name != "schedule" else name


class Schedule(ABC):
    """A value as a function of the step. Subclasses implement ``__call__``."""

    registry: ClassVar[dict[str, type[Schedule]]] = {}
    registered: ClassVar[bool] = True  # protocol bases set False: not a schedule name

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("registered", True):
            return
        name = str(cls.__dict__.get("TYPE") or _registry_key(cls.__name__)).lower()
        built_in = Schedule.registry.get(name)
        if built_in is not None and built_in.__module__ == __name__ and cls.__module__ != __name__:
            warnings.warn(f"schedule type {name!r} is built in, so {cls.__qualname__} is not "
                          f"registered under it; pass an instance of it, or give it another TYPE",
                          stacklevel=2)
            return
        Schedule.registry[name] = cls

    @abstractmethod
    def __call__(self, step: int) -> float: ...

    def value_at(self, step: int, is_update_step: bool = False) -> float:
        """The value at optimizer step ``step`` as a float (what the algorithms read)."""
        return float(self(step))

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
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class Constant(Schedule):
    """The same ``value`` at every step (what a number as ``sparsity`` becomes)."""

    def __init__(self, value: float) -> None:
        self.value = float(value)

    def __call__(self, step: int, is_update_step: bool = False) -> float:
        return self.value


class Linear(Schedule):
    """``init + slope * t``."""

    def __init__(self, init: float, slope: float) -> None:
        self.init, self.slope = float(init), float(slope)

    def __call__(self, step: int, is_update_step: bool = False) -> float:
        return self.init + self.slope * step


class Exp(Schedule):
    """``final + (init - final) * exp(-gamma * t)``: moves from ``init`` towards ``final``."""

    def __init__(self, init: float, gamma: float, final: float = 1.0) -> None:
        self.init, self.gamma, self.final = float(init), float(gamma), float(final)

    def __call__(self, step: int, is_update_step: bool = False) -> float:
        return self.final + (self.init - self.final) * math.exp(-self.gamma * step)


class Power(Schedule):
    """``init * (t + 1) ** beta`` (beta < 0 decays)."""

    def __init__(self, init: float, beta: float) -> None:
        self.init, self.beta = float(init), float(beta)

    def __call__(self, step: int, is_update_step: bool = False) -> float:
        return self.init * (step + 1) ** self.beta


class Cosine(Schedule):
    """``minimum + (init - minimum)/2 * (1 + cos(pi * t / half_period))``, held at ``minimum``
    after ``half_period`` (RigL's drop fraction with ``half_period = T_end``)."""

    def __init__(self, init: float, half_period: float, minimum: float = 0.0) -> None:
        if half_period <= 0:
            raise ValueError(f"half_period must be > 0, got {half_period}")
        self.init, self.half_period, self.minimum = float(init), float(half_period), float(minimum)

    def __call__(self, step: int, is_update_step: bool = False) -> float:
        t = min(step, self.half_period)
        return self.minimum + (self.init - self.minimum) * 0.5 * (
            1 + math.cos(math.pi * t / self.half_period)
        )


class Cycling(Schedule):
    """Cycles through ``values``, moving on every ``period`` steps (the update frequency)."""

    def __init__(self, values: Sequence[float], period: int = 1) -> None:
        if not values:
            raise ValueError("a cycling schedule needs at least one value")
        if period < 1:
            raise ValueError(f"period must be >= 1, got {period}")
        self.values, self.period = [float(v) for v in values], int(period)

    def __call__(self, step: int, is_update_step: bool = False) -> float:
        return self.values[(step // self.period) % len(self.values)]


class Lambda(Schedule):
    """Wraps a plain Python callable of the step (reference quirk 4, docs/design.md: plain functions accepted)."""

    def __init__(self, fn: Callable[[int], float]) -> None:
        if not callable(fn):
            raise ValueError(f"a lambda schedule needs a callable, got {type(fn).__name__}")
        self.fn = fn

    def __call__(self, step: int, is_update_step: bool = False) -> float:
        return float(self.fn(step))


class Polynomial(Schedule):
    """``final + (init - final) * (1 - p) ** power``, p the progress from ``begin_step`` to
    ``end_step`` counted in pruning periods of ``every`` steps (the periods step t,
    ``begin_step`` and ``end_step`` fall in, as the cstorch blog's cubic counts them), clamped
    to [0, 1]. With start 150, end 1150 and every 100, step 200 is one period of ten in."""

    def __init__(
        self, init: float, final: float, begin_step: int, end_step: int, power: float = 3.0, every: int = 1
    ) -> None:
        if end_step <= begin_step:
            raise ValueError(f"end_step ({end_step}) must be after begin_step ({begin_step})")
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.init, self.final, self.power = float(init), float(final), float(power)
        self.begin_step, self.end_step, self.every = int(begin_step), int(end_step), int(every)

    def __call__(self, step: int, is_update_step: bool = False) -> float:
        first = self.begin_step // self.every
        periods = max(1, self.end_step // self.every - first)
        progress = min(1.0, max(0, int(step) // self.every - first) / periods)
        return self.final + (self.init - self.final) * (1.0 - progress) ** self.power


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
        if not points or any(len(p) != 2 for p in points):
            raise ValueError("sparsity_schedule must be a non-empty list of [step, value] pairs")
        self.points = sorted((int(s), float(v)) for s, v in points)

    def __call__(self, step: int, is_update_step: bool = False) -> float:
        value = self.points[0][1]
        for boundary, v in self.points:
            if step >= boundary:
                value = v
        return value


class PeriodicSchedule(Schedule):
    """Another schedule repeated every ``period`` steps: ``schedule(t mod period)``, e.g. a drop
    fraction that decays by cosine and restarts every 1000 steps. ``schedule`` is anything
    ``make_schedule`` takes."""

    def __init__(self, schedule: Any, period: int) -> None:
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"period must be an int >= 1, got {period!r}")
        self.schedule, self.period = make_schedule(schedule), period

    def __call__(self, step: int, is_update_step: bool = False) -> float:
        return self.schedule.value_at(int(step) % self.period, is_update_step)


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


def make_schedule(value: Any, *, period: int = 1) -> Schedule:
    """Builds a schedule from a float, a ``{"type": ...}`` dict, a list (cycling every ``period``
    steps), a plain callable, or a :class:`Schedule` (returned as is)."""
    if isinstance(value, Schedule):
        return value
    if isinstance(value, bool):
        raise ValueError(f"a schedule value must be a number, dict, list or callable, got {value!r}")
    if isinstance(value, (int, float)):
        return Constant(value)
    if isinstance(value, (list, tuple)):
        return Cycling(value, period)
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


class UpdateSchedule(ABC):
    """Decides which optimizer steps (1-based) update the masks."""

    @abstractmethod
    def __call__(self, step: int) -> bool: ...

    @property
    def period(self) -> int:
        """Steps between updates, for cycling schedules (1 when irregular)."""
        return 1

    @property
    def last_step(self) -> int | None:
        """The last step that can update, if bounded (used to place cubic schedules)."""
        return None

    def last_update(self, until: int) -> int | None:
        """The last step in [1, until] that updates, or None (plans ask this of runs with
        millions of steps, so the schedules below answer it without a scan)."""
        return next((step for step in range(until, 0, -1) if self(step)), None)


class Periodic(UpdateSchedule):
    """Every ``freq`` steps from ``start`` (inclusive) to ``stop`` (exclusive)."""

    def __init__(self, freq: int, start: int = 0, stop: int | None = None) -> None:
        if int(freq) < 1:
            raise ValueError(f"update.freq must be >= 1, got {freq}")
        if int(start) < 0:
            raise ValueError(f"update.start must be >= 0, got {start}")
        if stop is not None and int(stop) <= int(start):
            raise ValueError(f"update.stop ({stop}) must be after update.start ({start})")
        self.freq, self.start = int(freq), int(start)
        self.stop = None if stop is None else int(stop)

    def __call__(self, step: int) -> bool:
        if step < max(self.start, 1) or (self.stop is not None and step >= self.stop):
            return False
        return (step - self.start) % self.freq == 0

    @property
    def period(self) -> int:
        return self.freq

    @property
    def last_step(self) -> int | None:
        return None if self.stop is None else self.stop - 1

    def last_update(self, until: int) -> int | None:
        end = until if self.stop is None else min(until, self.stop - 1)
        last = self.start + (end - self.start) // self.freq * self.freq
        return last if last >= max(self.start, 1) else None

    def __repr__(self) -> str:
        return f"Periodic(freq={self.freq}, start={self.start}, stop={self.stop})"


class AtSteps(UpdateSchedule):
    """Updates at the listed optimizer steps only (``update: {steps: [...]}``).

    Raises:
        ValueError: A step below 1.
    """

    def __init__(self, steps: Sequence[int]) -> None:
        self.steps = frozenset(int(s) for s in steps)
        if any(s < 1 for s in self.steps):
            raise ValueError(f"update.steps must be >= 1, got {sorted(self.steps)}")

    def __call__(self, step: int) -> bool:
        return step in self.steps

    @property
    def last_step(self) -> int | None:
        return max(self.steps) if self.steps else None

    def last_update(self, until: int) -> int | None:
        return max((step for step in self.steps if step <= until), default=None)


class UpdateWhen(UpdateSchedule):
    """A plain callable ``step -> bool`` (the reference raises on these: reference quirk 3, docs/design.md)."""

    def __init__(self, fn: Callable[[int], bool]) -> None:
        self.fn = fn

    def __call__(self, step: int) -> bool:
        return bool(self.fn(step))


class Never(UpdateSchedule):
    def __call__(self, step: int) -> bool:
        return False

    def last_update(self, until: int) -> int | None:
        return None


def make_update_schedule(value: Any) -> UpdateSchedule:
    """``None`` (never), int freq, ``{freq, start, stop}``, ``{steps: [...]}``, or a callable."""
    if value is None:
        return Never()
    if isinstance(value, UpdateSchedule):
        return value
    if isinstance(value, bool):
        raise ValueError(f"update must be an int, dict or callable, got {value!r}")
    if isinstance(value, int):
        return Periodic(value)
    if isinstance(value, dict):
        keys = set(value)
        if "steps" in keys:
            if keys != {"steps"}:
                raise ValueError(f"update with 'steps' takes no other keys, got {sorted(keys)}")
            return AtSteps(value["steps"])
        unknown = keys - {"freq", "start", "stop"}
        if unknown or "freq" not in keys:
            raise ValueError(
                f"update must be {{freq, start, stop}} or {{steps}}; got keys {sorted(keys)}"
            )
        return Periodic(**value)
    if callable(value):
        return UpdateWhen(value)
    raise ValueError(f"cannot make an update schedule from {type(value).__name__} {value!r}")
