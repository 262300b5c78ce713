"""``cstorch.sparse.utils``: hyper-parameter schedules, update schedules, score shapers and the
mask algebra, with cstorch 2.x's names, arguments and arithmetic.

Counts follow cstorch exactly: ``trunc(float32(1 - s) * n)`` per shaper row (80% of 640 keeps
127), top-k by ``torch.topk`` (ties in its order). Schedules take and return 0-d tensors.

One deliberate difference: a schedule's value is memoised per step *value*, so a step-varying
``drop_fraction`` varies (as on a CS system); the CPU/GPU reference memoises on the identity of
its in-place step tensor and freezes such a schedule at its first value.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._subclasses import concrete_subclasses

__all__ = [
    "HyperParameterSchedule", "Constant", "Linear", "Exp", "Power", "Cosine", "Cycling", "Lambda",
    "make_hyperparam_schedule", "UpdateSchedule", "FreqSchedule", "ListSchedule", "make_update_schedule",
    "ScoreShaper", "ScoreFlattener", "OutputGroupScoreShaper", "InputGroupScoreShaper",
    "ScoreTiebreaker", "RandomScoreTiebreaker", "FirstScoreTiebreaker", "make_tiebreaker",
    "make_mask_topk_sparsity", "make_mask_drop_minimum", "make_mask_grow_maximum",
]


def _as_step(step: Any) -> torch.Tensor:
    return step if isinstance(step, torch.Tensor) else torch.tensor(step, dtype=torch.float)


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


class HyperParameterSchedule(ABC):
    """A value per step. Subclasses implement ``compute(step)``; stateful ones (Cycling) also
    ``update(is_update_step)``, which runs once per optimizer step however many parameters
    share the schedule, whatever a subclass's ``update`` does; ``cache_clear()`` ends the step.
    A subclass is found in configs by its lowercase class name (``{"type": "cubic", ...}``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not getattr(cls.update, "runs_once_per_step", False):
            cls.update = _once_per_step(cls.update)  # type: ignore[method-assign]

    def __init__(self) -> None:
        self._memo: tuple[float, torch.Tensor] | None = None

    @abstractmethod
    def compute(self, step: torch.Tensor) -> torch.Tensor:
        """The value at ``step`` (a 0-d tensor)."""

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
        first, last = float(self(torch.tensor(begin))), float(self(torch.tensor(end)))
        return (min(first, last), max(first, last), last)


class Constant(HyperParameterSchedule):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.value)


class Linear(HyperParameterSchedule):
    """``init + slope * step``."""

    def __init__(self, init: float, slope: float) -> None:
        super().__init__()
        self.init, self.slope = torch.tensor(init), torch.tensor(slope)

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        return self.init + _as_step(step) * self.slope


class Exp(HyperParameterSchedule):
    """``final - (final - init) * exp(gamma * step)``."""

    def __init__(self, init: float, gamma: float, final: float = 1) -> None:
        super().__init__()
        self.final = torch.tensor(final)
        self.scale = self.final - torch.tensor(init)
        self.gamma = torch.tensor(gamma)

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        return self.final - self.scale * torch.exp(_as_step(step) * self.gamma)


class Power(HyperParameterSchedule):
    """``init * beta ** step``."""

    def __init__(self, init: float, beta: float) -> None:
        super().__init__()
        self.init, self.beta = torch.tensor(init), torch.tensor(beta)

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        return self.init * torch.pow(self.beta, _as_step(step))


class Cosine(HyperParameterSchedule):
    """From ``init`` down to ``minimum`` at ``half_period`` and back at twice that."""

    def __init__(self, init: float, half_period: float, minimum: float = 0.0) -> None:
        super().__init__()
        middle = (minimum + init) / 2
        self.amp, self.offset = torch.tensor(init - middle), torch.tensor(middle)
        self.freq = torch.tensor(math.pi / half_period)

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        return self.amp * torch.cos(_as_step(step) * self.freq) + self.offset

    def get_min_max_end(self, begin: int, end: int) -> tuple[float, float, float]:
        low, high = sorted((float(self.offset - self.amp), float(self.offset + self.amp)))
        return (low, high, float(self(torch.tensor(end))))


class Cycling(HyperParameterSchedule):
    """``values[index]``; the index moves on (wrapping) at each update step."""

    def __init__(self, values: Sequence[float]) -> None:
        super().__init__()
        self.values = list(values)
        self.index = torch.tensor(0, dtype=torch.int64)

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.values[int(self.index)])

    def update(self, is_update_step: Any) -> None:
        following = (self.index + 1) % len(self.values)
        # the value already read this step stays (memoised) until cache_clear() ends the step
        self.index = torch.where(torch.as_tensor(is_update_step, dtype=torch.bool), following, self.index)

    def get_min_max_end(self, begin: int, end: int) -> tuple[float, float, float]:
        return (min(self.values), max(self.values), self.values[-1])

    def visit_state(self, fn: Callable[[torch.Tensor], Any]) -> None:
        moved = fn(self.index)
        if moved is not None:
            self.index = moved

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = torch.as_tensor(state["index"], dtype=torch.int64)


class Lambda(HyperParameterSchedule):
    """``fn(step)``."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def compute(self, step: torch.Tensor) -> torch.Tensor:
        return self.fn(step)

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


# ----------------------------------------------------------------------- update schedules
class UpdateSchedule(ABC):
    """Which steps change masks: ``is_update_step(step) -> bool tensor``."""

    @abstractmethod
    def is_update_step(self, step: torch.Tensor) -> torch.Tensor:
        """True on update steps."""

    def __call__(self, step: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(self.is_update_step(step), dtype=torch.bool)


class FreqSchedule(UpdateSchedule):
    """Every ``freq`` steps from ``start``, before ``stop`` (exclusive)."""

    def __init__(self, freq: int = 1, start: int = 0, stop: int | None = None) -> None:
        for field, value in (("freq", freq), ("start", start)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if field == "freq" else 0):
                raise ValueError(f"update.{field} must be an int >= {1 if field == 'freq' else 0}, got {value!r}")
        self.freq, self.start, self.stop = freq, start, stop

    def is_update_step(self, step: torch.Tensor) -> torch.Tensor:
        step = torch.as_tensor(step)
        result = ((step - self.start) % self.freq == 0) & (step >= self.start)
        if self.stop is not None:
            result &= step < self.stop
        return result


class ListSchedule(UpdateSchedule):
    """Exactly the steps listed."""

    def __init__(self, steps: Sequence[int]) -> None:
        self.steps = tuple(int(s) for s in steps)
        if not self.steps:
            raise ValueError("update.steps must list at least one step")
        self.start, self.stop = min(self.steps), max(self.steps)

    def is_update_step(self, step: torch.Tensor) -> torch.Tensor:
        return torch.tensor(int(step) in self.steps)


def make_update_schedule(update: Any) -> UpdateSchedule | Callable[[torch.Tensor], torch.Tensor]:
    """``None`` → every step; ``{"freq", "start", "stop"}``; ``{"steps": [...]}``; an
    UpdateSchedule or a callable ``step -> bool tensor`` as is."""
    if update is None:
        return FreqSchedule()
    if isinstance(update, UpdateSchedule):
        return update
    if isinstance(update, dict):
        options = dict(update)
        if "steps" in options:
            return ListSchedule(options.pop("steps"))
        unknown = set(options) - {"freq", "start", "stop"}
        if unknown:
            raise ValueError(f"update: unknown keys {sorted(unknown)}; use freq/start/stop or steps")
        return FreqSchedule(**options)
    if callable(update):
        return update
    raise ValueError(f"update must be None, {{'freq', 'start', 'stop'}}, {{'steps': [...]}} or a "
                     f"callable, got {update!r}")


# ------------------------------------------------------------------ shapers and tie-breaks
Unshaper = Callable[[torch.Tensor], torch.Tensor]


class ScoreShaper(ABC):
    """``shaper(tensor) -> (rows, unshape)``: top-k and counts are per row. Any callable with
    this contract works where a shaper is expected."""

    @abstractmethod
    def __call__(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Unshaper]:
        """The tensor as ``[rows, row_len]`` and the function that undoes it."""


class ScoreFlattener(ScoreShaper):
    """One row: a single competition over the whole tensor."""

    def __call__(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Unshaper]:
        return tensor.reshape(-1), lambda rows: rows.reshape(tensor.shape)


class OutputGroupScoreShaper(ScoreShaper):
    """``num_groups`` rows of consecutive output rows (equal density per output block)."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups

    def __call__(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Unshaper]:
        return tensor.reshape(self.num_groups, -1), lambda rows: rows.reshape(tensor.shape)


class InputGroupScoreShaper(ScoreShaper):
    """``num_groups`` rows of consecutive input columns of a 2-D weight."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups

    def __call__(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Unshaper]:
        out_features, in_features = tensor.shape
        rows = tensor.t().reshape(self.num_groups, -1)
        return rows, lambda shaped: shaped.reshape(in_features, out_features).t().contiguous()


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


def _shape(score: torch.Tensor, score_shaper: Callable | None) -> tuple[torch.Tensor, Unshaper]:
    shaped = (score_shaper or ScoreFlattener())(score)
    if not (isinstance(shaped, tuple) and len(shaped) == 2 and callable(shaped[1])):
        raise TypeError(f"score_shaper must return (tensor, unshaper), got {type(shaped).__name__}")
    return shaped


# --------------------------------------------------------------------------- mask algebra
def _dense_count(density: torch.Tensor, row_len: int) -> torch.Tensor:
    """cstorch's count: ``trunc(float32(density) * row_len)``."""
    return (torch.as_tensor(density, dtype=torch.float32) * torch.tensor(row_len, dtype=torch.float32)).int()


def _topk_k(score: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per row (last dim), True at the ``k`` largest scores (``torch.topk`` order on ties)."""
    _, indices = torch.topk(score, int(k), dim=-1)
    return torch.zeros_like(score, dtype=torch.bool).scatter(-1, indices, True)


def make_mask_topk_sparsity(score: torch.Tensor, sparsity: Any,
                            score_shaper: Callable | None = None) -> torch.Tensor:
    """Keeps the top ``trunc(f32(1 - sparsity) * row_len)`` scores of each shaper row."""
    rows, unshape = _shape(score, score_shaper)
    return unshape(_topk_k(rows, _dense_count(1 - torch.as_tensor(sparsity), rows.size(-1))))


def make_mask_drop_minimum(score: torch.Tensor, mask: torch.Tensor, drop_fraction: Any,
                           score_shaper: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Drops ``drop_fraction`` of the active count by lowest score; returns (mask, kept per row).
    As in cstorch the kept positions are the top scores over the whole row (pruned positions
    score |w| = 0, so they only win ties), and the count spreads ``mask.sum()`` evenly over rows."""
    rows, unshape = _shape(score, score_shaper)
    groups = math.prod(rows.shape[:-1])
    active_per_row = mask.sum().float() / groups
    kept = ((1 - torch.as_tensor(drop_fraction)) * active_per_row).int()
    return unshape(_topk_k(rows, kept)), kept


def make_mask_grow_maximum(score: torch.Tensor, mask: torch.Tensor, sparsity: Any,
                           mask_nonzero: torch.Tensor | None = None,
                           score_shaper: Callable | None = None) -> torch.Tensor:
    """Adds, per row, the top-scoring positions outside ``mask`` until the row holds
    ``trunc(f32(1 - sparsity) * row_len)`` (never removes any)."""
    rows, unshape = _shape(torch.where(mask, float("-inf"), score), score_shaper)
    target = _dense_count(1 - torch.as_tensor(sparsity), rows.size(-1))
    current = mask.sum().int() if mask_nonzero is None else torch.as_tensor(mask_nonzero)
    grow = torch.clamp(target - current, min=0)
    return mask.logical_or(unshape(_topk_k(rows, grow)))
