"""``cstorch.sparse.utils``: hyper-parameter schedules, update schedules, score shapers and the
mask algebra, with cstorch 2.x's names and arguments.

The schedules, update schedules and shapers are the engine's (``sparsity.schedules``,
``sparsity.update_schedules``, ``sparsity.masks``): each class here is the engine's class with
cstorch's protocol on top (``HyperParameterSchedule``: a value per step tensor, memoised, and
``update(is_update_step)`` for stateful ones). The mask algebra and cstorch's reading of
``update`` are cstorch's rules where they differ from the engine's
(:mod:`sparsity.cstorch.sparse.reference_rules`).

One deliberate difference: a schedule's value is memoised per step *value*, so a step-varying
``drop_fraction`` varies (as on a CS system); the CPU/GPU reference memoises on the identity of
its in-place step tensor and freezes such a schedule at its first value.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from ... import schedules
from ...masks import InputGroupScoreShaper, OutputGroupScoreShaper, ScoreFlattener, ScoreShaper
from ...update_schedules import AtSteps as ListSchedule
from ...update_schedules import Periodic as FreqSchedule
from ...update_schedules import UpdateSchedule
from .._subclasses import concrete_subclasses
from .reference_rules import (make_mask_drop_minimum, make_mask_grow_maximum, make_mask_topk_sparsity,
                              make_update_schedule)

__all__ = [
    "HyperParameterSchedule", "Constant", "Linear", "Exp", "Power", "Cosine", "Cycling", "Lambda",
    "make_hyperparam_schedule", "UpdateSchedule", "FreqSchedule", "ListSchedule", "make_update_schedule",
    "ScoreShaper", "ScoreFlattener", "OutputGroupScoreShaper", "InputGroupScoreShaper",
    "ScoreTiebreaker", "RandomScoreTiebreaker", "FirstScoreTiebreaker", "make_tiebreaker",
    "make_mask_topk_sparsity", "make_mask_drop_minimum", "make_mask_grow_maximum",
]

# ------------------------------------------------------------------------ hyper-parameters
_NOT_YET = object()  # no update this step (None could be an argument)


def _once_per_step(update: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """``update`` that runs once per ``is_update_step`` object until ``cache_clear()``.

    An algorithm passes the same tensor to the schedule of each of its parameters within a
    step (and ``starts_sparse`` at ``apply``), so a schedule shared by several parameters
    advances once, as cstorch's per-instance cache of ``update`` makes it. The object is held,
    not its ``id``, so a freed tensor's address cannot pass for it. A subclass's ``update``
    that calls ``super().update()`` runs the parent's in full."""

    @functools.wraps(update)
    def guarded(self: Any, is_update_step: Any) -> None:
        if self.__dict__.get("_updating"):  # a super().update() call inside the running update
            update(self, is_update_step)
            return
        if self.__dict__.get("_updated_with", _NOT_YET) is is_update_step:
            return
        self._updating = True
        try:
            update(self, is_update_step)
        finally:
            self._updating = False
        self._updated_with = is_update_step

    guarded.runs_once_per_step = True  # type: ignore[attr-defined]
    return guarded


class HyperParameterSchedule(schedules.Schedule):
    """cstorch's protocol on an engine schedule: ``schedule(step)`` is ``compute(step)`` (a
    0-d tensor; subclasses implement ``compute``) memoised for the step; stateful ones (Cycling)
    also ``update(is_update_step)``, which runs once per optimizer step however many parameters
    share the schedule, whatever a subclass's ``update`` does; ``cache_clear()`` ends the step.
    A subclass is found in configs by its lowercase class name (``{"type": "cubic", ...}``)."""

    config_names = False  # cstorch finds its schedules by class name (make_hyperparam_schedule)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not getattr(cls.update, "runs_once_per_step", False):
            cls.update = _once_per_step(cls.update)  # type: ignore[method-assign]

    def __init__(self) -> None:
        super().__init__()
        self._memo: tuple[float, torch.Tensor] | None = None

    @abstractmethod
    def compute(self, step: torch.Tensor) -> torch.Tensor:
        """The value at ``step`` (cstorch's int64 0-d tensor), as a 0-d tensor."""

    def __call__(self, step: Any) -> torch.Tensor:
        key = float(step)
        if self._memo is None or self._memo[0] != key:
            self._memo = (key, torch.as_tensor(self.compute(step)))
        return self._memo[1]

    def update(self, is_update_step: Any) -> None:
        """Advances a stateful schedule (called each step after the step's value is read, and
        once at ``apply``); stateless schedules keep no state."""

    def cache_clear(self) -> None:
        self._memo = None
        self.__dict__.pop("_updated_with", None)

    def visit_state(self, fn: Callable[[torch.Tensor], Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def get_min_max_end(self, begin: int, end: int) -> tuple[float, float, float] | None:
        """cstorch's estimate: the values at ``begin`` and ``end``, taken as the extremes."""
        first, last = float(self(torch.tensor(begin))), float(self(torch.tensor(end)))
        return (min(first, last), max(first, last), last)


class Constant(schedules.Constant, HyperParameterSchedule):
    """``value``."""


class Linear(schedules.Linear, HyperParameterSchedule):
    """``init + slope * step``."""


class Exp(schedules.Exp, HyperParameterSchedule):
    """``final - (final - init) * exp(gamma * step)``."""


class Power(schedules.Power, HyperParameterSchedule):
    """``init * beta ** step``."""


class Cosine(schedules.Cosine, HyperParameterSchedule):
    """From ``init`` down to ``minimum`` at ``half_period`` and back at twice that."""

    def get_min_max_end(self, begin: int, end: int) -> tuple[float, float, float]:
        amplitude, _, offset = self.terms(torch.tensor(end))
        low, high = sorted((float(offset - amplitude), float(offset + amplitude)))
        return (low, high, float(self(torch.tensor(end))))


class Cycling(schedules.Cycling, HyperParameterSchedule):
    """``values[index]``; the index moves on (wrapping) at each update step."""

    def get_min_max_end(self, begin: int, end: int) -> tuple[float, float, float]:
        return (min(self.values), max(self.values), self.values[-1])


class Lambda(schedules.Lambda, HyperParameterSchedule):
    """``fn(step)``."""

    def get_min_max_end(self, begin: int, end: int) -> None:
        return None


def make_hyperparam_schedule(schedule: Any) -> HyperParameterSchedule:
    """A number → Constant, a list → Cycling, ``{"type": name, ...}`` → that class (any
    subclass, by lowercase name), a one-argument callable → Lambda, a schedule → itself."""
    if isinstance(schedule, HyperParameterSchedule):
        return schedule
    if isinstance(schedule, bool):
        raise ValueError(f"a schedule cannot be a bool, got {schedule!r}")
    if isinstance(schedule, (int, float)):
        return Constant(schedule)
    if isinstance(schedule, (list, tuple)):
        return Cycling(schedule)
    if isinstance(schedule, dict):
        options = dict(schedule)
        name = options.pop("type", None)
        known = concrete_subclasses(HyperParameterSchedule)
        if not name or str(name).lower() not in known:
            raise ValueError(f"schedule 'type' must be one of {sorted(known)}, got {name!r}")
        return known[str(name).lower()](**options)
    if callable(schedule):
        return Lambda(schedule)
    raise ValueError(f"cannot make a schedule of {schedule!r}: give a number, a list, "
                     f"{{'type': ...}}, a callable or a HyperParameterSchedule")


# ------------------------------------------------------------------------- tie-breaks (2.0)
class ScoreTiebreaker:
    """cstorch 2.0's tie-break protocol: ``tiebreaker(score) -> score`` with ties separated.
    The base adds nothing (``torch.topk`` order decides)."""

    def __call__(self, score: torch.Tensor) -> torch.Tensor:
        return score


class RandomScoreTiebreaker(ScoreTiebreaker):
    """Adds U(0, eps) noise (global RNG, as cstorch)."""

    def __init__(self, eps: float = 1e-6) -> None:
        self.eps = eps

    def __call__(self, score: torch.Tensor) -> torch.Tensor:
        return score + torch.rand_like(score) * self.eps


class FirstScoreTiebreaker(ScoreTiebreaker):
    """Adds ``flat_index * eps / numel``: among equal scores the later flat index wins."""

    def __init__(self, eps: float = 1e-6) -> None:
        self.eps = eps

    def __call__(self, score: torch.Tensor) -> torch.Tensor:
        ramp = torch.arange(score.numel(), dtype=score.dtype, device=score.device).reshape(score.shape)
        return score + ramp * (self.eps / score.numel())


def make_tiebreaker(tiebreak: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``None``; ``{"type": "random"|"first"|"none", "eps": ...}``; or any callable."""
    if tiebreak is None or callable(tiebreak):
        return tiebreak
    if isinstance(tiebreak, dict):
        options = dict(tiebreak)
        kinds = {"none": ScoreTiebreaker, "random": RandomScoreTiebreaker, "first": FirstScoreTiebreaker}
        kind = str(options.pop("type", "none")).lower()
        if kind not in kinds:
            raise ValueError(f"tiebreak.type must be one of {sorted(kinds)}, got {kind!r}")
        return kinds[kind](**options) if kind != "none" else ScoreTiebreaker()
    raise ValueError(f"tiebreak must be a dict or a callable, got {tiebreak!r}")
