"""``cstorch.sparse.static``: ``Static``, a mask fixed at initialisation."""

from __future__ import annotations

from typing import Any

import torch

from .base import SparsityAlgorithm

__all__ = ["Static"]


class Static(SparsityAlgorithm):
    def __init__(self, sparsity: float | None = None, **kwargs: Any) -> None:
        if sparsity is not None:
            if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)):
                raise ValueError(f"Static sparsity must be a constant number, got {sparsity!r}")
            if not 0.0 <= sparsity < 1.0:
                raise ValueError(f"Static sparsity must be in [0, 1), got {sparsity!r}")
            sparsity = float(sparsity)  # cstorch refuses an int such as 0; a number is a number
        self.sparsity_level = sparsity
        super().__init__(sparsity, **kwargs)

    def update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Masks never change; both hooks fire every step with ``"*"`` and the level."""
        for hook in self._target_sparsity_hooks.values():
            hook(self, "*", self.sparsity_level)
        for hook in self._computed_sparsity_hooks.values():
            hook(self, "*", self.sparsity_level)
