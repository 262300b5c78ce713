"""Initial masks: how ``apply(model)`` chooses the first mask of each parameter.

Each method takes (weight, sparsity, generator) and returns a bool mask; user callables with the
same signature are accepted as ``init_method``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .masks import keep_count, topk_mask

__all__ = ["INIT_METHODS"]


def _init_random(p: torch.Tensor, sparsity: float, generator: torch.Generator) -> torch.Tensor:
    score = torch.rand(p.numel(), generator=generator).reshape(1, -1)
    return topk_mask(score, keep_count(p.numel(), sparsity)).reshape(p.shape)


def _init_topk(p: torch.Tensor, sparsity: float, generator: torch.Generator) -> torch.Tensor:
    return topk_mask(p.abs().reshape(1, -1), keep_count(p.numel(), sparsity)).reshape(p.shape)


def _init_from_zeros(p: torch.Tensor, sparsity: float, generator: torch.Generator) -> torch.Tensor:
    """Keep exactly the non-zero weights (a model pruned elsewhere); the level is ignored."""
    return p != 0


def _init_checkerboard(p: torch.Tensor, sparsity: float, generator: torch.Generator) -> torch.Tensor:
    """Evenly spaced kept positions in flat order: exact count, no randomness."""
    n, k = p.numel(), keep_count(p.numel(), sparsity)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[(torch.arange(k, dtype=torch.float64) * n / max(k, 1)).long()] = True
    return mask.reshape(p.shape)


INIT_METHODS: dict[str, Callable[[torch.Tensor, float, torch.Generator], torch.Tensor]] = {
    "random": _init_random,
    "topk": _init_topk,
    "from_zeros": _init_from_zeros,
    "checkerboard": _init_checkerboard,
}
