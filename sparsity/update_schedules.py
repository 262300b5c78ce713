"""Update schedules: which steps change the masks. One set of classes for both APIs: the
YAML path (``sparsity.configure``) asks with ints, ``sparsity.cstorch`` (cstorch's
``FreqSchedule`` / ``ListSchedule``) with 0-d int tensors, and each gets its answer in the type
it asked in.

Steps count optimizer steps; step 0 is the one before the first (the initial mask). As in
cstorch, ``Periodic(freq)`` answers True at step 0, which is how cstorch decides that an
algorithm starts sparse; the engine's algorithms never update at step 0 (they start sparse
always), so for them the question only matters to a cycling schedule's count.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["UpdateSchedule", "Periodic", "AtSteps", "UpdateWhen", "Never", "make_update_schedule"]


class UpdateSchedule(ABC):
    """Decides which steps update the masks. Subclasses implement :meth:`is_update_step`
    (cstorch's name), written so that an int and a 0-d tensor both work."""

    @abstractmethod
    def is_update_step(self, step: Any) -> Any:
        """Whether ``step`` (an int or a 0-d int tensor) updates the masks."""

    def __call__(self, step: Any) -> Any:
        answer = self.is_update_step(step)
        return torch.as_tensor(answer, dtype=torch.bool) if isinstance(step, torch.Tensor) else bool(answer)

    @property
    def last_step(self) -> int | None:
        """The last step that can update, if bounded (used to place cubic schedules)."""
        return None

    def last_update(self, until: int) -> int | None:
        """The last step in [1, until] that updates, or None (plans ask this of runs with
        millions of steps, so the schedules below answer it without a scan)."""
        return next((step for step in range(until, 0, -1) if self(step)), None)

    def count(self, begin: int, end: int) -> int:
        """How many steps in [begin, end) update (a cycling schedule's position)."""
        return sum(1 for step in range(begin, end) if self(step))


class Periodic(UpdateSchedule):
    """Every ``freq`` steps from ``start`` (inclusive) to ``stop`` (exclusive): cstorch's
    ``FreqSchedule``.

    Raises:
        ValueError: ``freq`` below 1, ``start`` below 0, or ``stop`` not after ``start``.
    """

    def __init__(self, freq: int = 1, start: int = 0, stop: int | None = None) -> None:
        for field, value, low in (("freq", freq, 1), ("start", start, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"update.{field} must be an int >= {low}, got {value!r}")
        if stop is not None and (isinstance(stop, bool) or not isinstance(stop, int) or stop <= start):
            raise ValueError(f"update.stop ({stop!r}) must be an int after update.start ({start})")
        self.freq, self.start, self.stop = freq, start, stop

    def is_update_step(self, step: Any) -> Any:
        hit = ((step - self.start) % self.freq == 0) & (step >= self.start)
        return hit if self.stop is None else hit & (step < self.stop)

    @property
    def last_step(self) -> int | None:
        return None if self.stop is None else self.stop - 1

    def last_update(self, until: int) -> int | None:
        end = until if self.stop is None else min(until, self.stop - 1)
        last = self.start + (end - self.start) // self.freq * self.freq
        return last if last >= max(self.start, 1) else None

    def count(self, begin: int, end: int) -> int:
        low, high = max(begin, self.start), end if self.stop is None else min(end, self.stop)
        first = self.start - (self.start - low) // self.freq * self.freq  # the first hit >= low
        return 0 if first >= high else (high - 1 - first) // self.freq + 1

    def __repr__(self) -> str:
        return f"Periodic(freq={self.freq}, start={self.start}, stop={self.stop})"


class AtSteps(UpdateSchedule):
    """Updates at the listed steps only (``update: {steps: [...]}``): cstorch's ``ListSchedule``.

    Raises:
        ValueError: A negative step.
    """

    def __init__(self, steps: Sequence[int]) -> None:
        self.steps = tuple(int(s) for s in steps)
        if any(s < 0 for s in self.steps):
            raise ValueError(f"update.steps must be >= 0, got {sorted(self.steps)}")

    def is_update_step(self, step: Any) -> Any:
        if isinstance(step, torch.Tensor):
            return torch.isin(step, torch.tensor(self.steps, dtype=step.dtype, device=step.device))
        return step in self.steps

    @property
    def start(self) -> int | None:
        """The first listed step (cstorch's attribute)."""
        return min(self.steps, default=None)

    @property
    def stop(self) -> int | None:
        """The last listed step (cstorch's attribute)."""
        return max(self.steps, default=None)

    @property
    def last_step(self) -> int | None:
        return self.stop

    def last_update(self, until: int) -> int | None:
        return max((step for step in self.steps if 1 <= step <= until), default=None)

    def count(self, begin: int, end: int) -> int:
        return sum(1 for step in set(self.steps) if begin <= step < end)


class UpdateWhen(UpdateSchedule):
    """A plain callable ``step -> bool`` (the reference raises on these: reference quirk 3, docs/design.md)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def is_update_step(self, step: Any) -> Any:
        return self.fn(step)


class Never(UpdateSchedule):
    """No step updates (the YAML path's ``update: null``)."""

    def is_update_step(self, step: Any) -> Any:
        return False

    def last_update(self, until: int) -> int | None:
        return None

    def count(self, begin: int, end: int) -> int:
        return 0


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
