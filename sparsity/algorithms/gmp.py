"""Gradual magnitude pruning (Zhu & Gupta 2017, arXiv:1710.01878)."""

from __future__ import annotations

import torch

from ..base import DynamicSparsityAlgorithm
from ..masks import keep_count, keep_top_active


class GMP(DynamicSparsityAlgorithm):
    """Keep the top-|w| entries at the scheduled sparsity; pruned weights never return.

    Takes the arguments of [`DynamicSparsityAlgorithm`][sparsity.DynamicSparsityAlgorithm]:
    ``sparsity`` is usually a rising schedule (e.g. ``{"type": "cubic", ...}``), and on each
    ``update`` step the smallest active weights are pruned to reach it.
    """

    def update_mask(self, p: torch.nn.Parameter, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        keep = keep_count(p.numel(), sparsity)
        return keep_top_active(p.detach().abs(), mask, keep, self.tie_breaker(p))
