"""Where cstorch 2.10 and the engine (``sparsity``) disagree, cstorch's rule, each written once
here for ``sparsity.cstorch``; docs/cstorch.md, "`sparsity`: our own API", lists them beside
the engine's. Everything else (schedules, update schedules, shapers, filters, group routing)
``sparsity.cstorch`` takes from the engine unchanged.

- Counts: ``trunc(float32(1 - sparsity) * row_len)`` per shaper row (80% of 640 keeps 127;
  the engine rounds in float64 and keeps 128).
- Order: ``torch.topk``'s among equal scores (the engine breaks ties by a seeded rule).
- Randomness: the global RNG (``torch.rand_like``), drawn by SET every step, update step or
  not (the engine: generators seeded by seed, step and name, on update steps only).
- Precision: schedules evaluated in float32 (the engine: float64), since ``compute`` gets
  cstorch's int64 step.
- Cadence: ``update=None`` means every step (the engine refuses a dynamic algorithm without
  one), and a cadence that does not include step 0 starts dense (the engine starts sparse).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ...masks import ScoreFlattener
from ...update_schedules import AtSteps, Periodic, UpdateSchedule

__all__ = ["make_mask_topk_sparsity", "make_mask_drop_minimum", "make_mask_grow_maximum", "random_scores",
           "make_update_schedule", "starts_sparse"]

Unshaper = Callable[[torch.Tensor], torch.Tensor]


def _shape(score: torch.Tensor, score_shaper: Callable | None) -> tuple[torch.Tensor, Unshaper]:
    shaped = (score_shaper or ScoreFlattener())(score)
    if not (isinstance(shaped, tuple) and len(shaped) == 2 and callable(shaped[1])):
        raise TypeError(f"score_shaper must return (tensor, unshaper), got {type(shaped).__name__}")
    return shaped


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


def random_scores(p: torch.Tensor, device: Any = None) -> torch.Tensor:
    """Uniform scores of ``p``'s shape from the global RNG (SET's growth, the random init)."""
    return torch.rand_like(p, device=device or p.device)


def make_update_schedule(update: Any) -> UpdateSchedule | Callable[[torch.Tensor], torch.Tensor]:
    """cstorch's reading of ``update``: ``None`` → every step; ``{"freq", "start", "stop"}``;
    ``{"steps": [...]}``; an UpdateSchedule or a callable ``step -> bool tensor`` as is."""
    if update is None:
        return Periodic()
    if isinstance(update, UpdateSchedule):
        return update
    if isinstance(update, dict):
        options = dict(update)
        if "steps" in options:
            steps = options.pop("steps")
            if not steps:
                raise ValueError("update.steps must list at least one step")
            return AtSteps(steps)
        unknown = set(options) - {"freq", "start", "stop"}
        if unknown:
            raise ValueError(f"update: unknown keys {sorted(unknown)}; use freq/start/stop or steps")
        return Periodic(**options)
    if callable(update):
        return update
    raise ValueError(f"update must be None, {{'freq', 'start', 'stop'}}, {{'steps': [...]}} or a "
                     f"callable, got {update!r}")


def starts_sparse(update_schedule: Callable[[torch.Tensor], Any]) -> torch.Tensor:
    """Whether an algorithm starts sparse: iff step 0 is an update step of its cadence (else
    cstorch trains dense until the first update); a 0-d bool tensor, as cstorch hands it to
    the schedules' ``update``."""
    return torch.as_tensor(update_schedule(torch.tensor(0, dtype=torch.int64)), dtype=torch.bool)
