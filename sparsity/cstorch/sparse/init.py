"""``cstorch.sparse.init``: initial masks, ``init(p, sparsity, score_shaper=None, device=None)``.

``random`` draws its scores from the global RNG (``torch.rand_like``) as cstorch does, so a
seeded script gets the reference's masks. A callable of any signature accepting those four
arguments is taken (cstorch insists on exact type annotations).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .reference_rules import random_scores
from .utils import make_mask_topk_sparsity

__all__ = ["random", "topk", "from_zeros", "checkerboard", "make_init_method", "INIT_METHODS"]

InitMethod = Callable[..., torch.Tensor]


def random(p: torch.Tensor, sparsity: torch.Tensor, score_shaper: Any = None, device: Any = None) -> torch.Tensor:
    """A uniformly random mask with the exact count."""
    return make_mask_topk_sparsity(random_scores(p, device), sparsity, score_shaper)


def topk(p: torch.Tensor, sparsity: torch.Tensor, score_shaper: Any = None, device: Any = None) -> torch.Tensor:
    """Keeps the largest |w| (one-shot magnitude pruning)."""
    return make_mask_topk_sparsity(p.detach().to(device or p.device).abs(), sparsity, score_shaper)


def from_zeros(p: torch.Tensor, sparsity: torch.Tensor, score_shaper: Any = None, device: Any = None) -> torch.Tensor:
    """Active where the weight is non-zero (importing pruned weights); ignores ``sparsity``."""
    return p.detach().to(device or p.device) != 0


def checkerboard(p: torch.Tensor, sparsity: torch.Tensor, score_shaper: Any = None, device: Any = None) -> torch.Tensor:
    """A deterministic, evenly spread pattern over the last dimension, rolled row by row."""
    density = 1 - float(sparsity)
    columns = p.shape[-1]
    positions = torch.floor(torch.arange(columns + math.ceil(columns / density + 1e-5)) * density + 1e-5)
    row = positions[1:] != positions[:-1]
    if p.dim() == 2:
        shift = -math.floor(1 / density - 1e-5)
        row = torch.stack([torch.roll(row, r * shift) for r in range(p.shape[0])])
    return row[..., :columns].clone()


INIT_METHODS: dict[str, InitMethod] = {
    "random": random, "topk": topk, "from_zeros": from_zeros, "checkerboard": checkerboard,
}


def make_init_method(init_method: str | InitMethod) -> InitMethod:
    if isinstance(init_method, str):
        if init_method not in INIT_METHODS:
            raise ValueError(f"init_method must be one of {sorted(INIT_METHODS)} or a callable, got {init_method!r}")
        return INIT_METHODS[init_method]
    if callable(init_method):
        return init_method
    raise ValueError(f"init_method must be a name or a callable, got {init_method!r}")
