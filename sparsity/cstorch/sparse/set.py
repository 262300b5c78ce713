"""``cstorch.sparse.set``: ``SET``, drop the smallest |w|, regrow at random (global RNG)."""

from __future__ import annotations

from typing import Any

import torch

from .dynamic import DynamicSparsityAlgorithm
from .reference_rules import random_scores
from .utils import make_hyperparam_schedule, make_mask_drop_minimum, make_mask_grow_maximum

__all__ = ["SET"]


class SET(DynamicSparsityAlgorithm):
    def __init__(self, drop_fraction: Any = 0.3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.drop_fraction = make_hyperparam_schedule(drop_fraction)

    def _end_step(self) -> None:
        super()._end_step()
        self.drop_fraction.cache_clear()

    @torch.no_grad()
    def update_mask(self, p: torch.Tensor, mask: torch.Tensor, sparsity: torch.Tensor) -> torch.Tensor:
        drop_fraction = self.drop_fraction(self.step)
        self.drop_fraction.update(self.is_update_step)
        kept_mask, kept = make_mask_drop_minimum(p.abs(), mask, drop_fraction)
        # drawn every step, update step or not, as cstorch does (same global RNG stream)
        return make_mask_grow_maximum(random_scores(p), kept_mask, sparsity, kept)
