"""Sparse Evolutionary Training (Mocanu et al. 2018, arXiv:1707.04780)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..base import DynamicSparsityAlgorithm
from ..masks import ScoreFlattener, ScoreShaper, count_per_row, drop_minimum, grow_maximum, keep_count
from ..schedules import make_schedule


class SET(DynamicSparsityAlgorithm):
    """Each update drops ``floor(df · nnz)`` smallest |w| among active entries and grows as many
    uniformly at random among inactive ones (just-dropped allowed); grown weights start at 0.

    When the target level moves between updates the extra difference is dropped (or grown) in
    the same update, so nnz equals the scheduled target after every update (reference bug 5).
    """

    # update_mask zeroes all it drops; a subclass replacing it without calling it sets False
    zeroes_dropped = True

    def __init__(self, sparsity: Any = None, *, update: Any = None, drop_fraction: Any = 0.3, **kwargs: Any) -> None:
        super().__init__(sparsity, update=update, **kwargs)
        self.drop_fraction = make_schedule(drop_fraction, period=self.update_schedule.period)
        self.shaper: ScoreShaper = ScoreFlattener()

    def drop_score(self, p: torch.nn.Parameter) -> torch.Tensor:
        return p.detach().abs()

    def grow_score(self, p: torch.nn.Parameter) -> torch.Tensor:
        return torch.rand(p.shape, generator=self.generator(p))

    def update_mask(self, p: torch.nn.Parameter, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        fraction = float(self.drop_fraction(self.step))
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"drop_fraction must be in [0, 1] at step {self.step}, got {fraction!r}")
        grouped = self.shaper.shape(mask)
        target = keep_count(grouped.shape[1], sparsity)
        nnz = count_per_row(grouped).tolist()
        n_drop = [min(math.floor(fraction * n) + max(n - target, 0), n) for n in nnz]
        ties = self.tie_breaker(p)
        kept = drop_minimum(self.shaper.shape(self.drop_score(p)), grouped, torch.tensor(n_drop), ties)
        # drop_minimum drops exactly n_drop per group, so what is left needs no counting
        n_grow = torch.tensor([target - (n - d) for n, d in zip(nnz, n_drop)])
        grown = grow_maximum(self.shaper.shape(self.grow_score(p)), kept, n_grow, ties)
        # Zero everything the drop removed before returning the grown mask: an entry regrown in
        # this same update starts from zero like any other grown entry.
        self.zero_outside(p, self.shaper.unshape(kept, mask.shape))
        return self.shaper.unshape(grown, mask.shape)


