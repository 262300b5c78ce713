"""``cstorch.sparse.gmp``: ``GMP``, gradual magnitude pruning to a scheduled level."""

from __future__ import annotations

from typing import Any

import torch

from .dynamic import DynamicSparsityAlgorithm
from .utils import Constant, make_mask_topk_sparsity, make_tiebreaker

__all__ = ["GMP"]


class GMP(DynamicSparsityAlgorithm):
    """Keeps the largest |w| of each tensor at ``sparsity(step)``; the schedule must vary.
    ``tiebreak`` (cstorch 2.0): ``{"type": "random"|"first", "eps": ...}`` or a callable
    ``score -> score``."""

    def __init__(self, tiebreak: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(self.sparsity.default, Constant):
            raise ValueError(f"GMP was given a constant sparsity {self.sparsity.default.value}; the masks would "
                             "never change. Use algorithm 'static' for a fixed mask.")
        self.tiebreak = make_tiebreaker(tiebreak)

    @torch.no_grad()
    def update_mask(self, p: torch.Tensor, mask: torch.Tensor, sparsity: torch.Tensor) -> torch.Tensor:
        score = p.abs()
        return make_mask_topk_sparsity(self.tiebreak(score) if self.tiebreak else score, sparsity)
