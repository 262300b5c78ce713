"""A diagnostic RigL variant for research/rigl_cause.py: an experiment, not a method.

`FreshRigL` may not grow back what it has just dropped (RigL's reference code may), so every
grown connection is a new one, as in SET: it tests whether RigL trails SET because regrowing
its own drops explores fewer connections (a lower ITOP rate).
"""

from __future__ import annotations

import torch

from sparsity.algorithms.rigl import RigL


class FreshRigL(RigL):
    """RigL that grows only connections inactive before the update."""

    def update_mask(self, p: torch.nn.Parameter, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        self._active_before = mask.clone()
        return super().update_mask(p, mask, sparsity)

    def grow_score(self, p: torch.nn.Parameter) -> torch.Tensor:
        return super().grow_score(p).masked_fill_(self._active_before, -1.0)  # below any |g|
