"""Diagnostic RigL variants for bench/rigl_cause.py: experiments, not methods.

`SinkhornRigL` grows by the |dense gradient| rescaled to equal row and column sums (Sinkhorn
iterations). A linear layer's gradient is a sum of outer products δ xᵀ, so its largest entries
sit where a large back-propagated error meets a large input: few output rows and few input
columns, the same ones from update to update. Balancing the growth per row (or per column) only
moves that pile-up to the other side. The rescaled score removes the outer-product scale from
the choice and keeps what the gradient says about which pairs interact: if RigL then matches
SET, the pile-up is what costs it; if not, gradient growth itself is the weaker choice here.

`FreshRigL` may not grow back what it has just dropped (RigL's reference code may), so every
grown connection is a new one, as in SET: it tests whether RigL trails SET because regrowing its
own drops explores fewer connections (lower ITOP rate).
"""

from __future__ import annotations

import torch

from sparsity.algorithms.rigl import RigL

SINKHORN_ITERATIONS = 20


class SinkhornRigL(RigL):
    """RigL whose growth score has equal row sums and equal column sums."""

    def grow_score(self, p: torch.nn.Parameter) -> torch.Tensor:
        score = super().grow_score(p).double().add_(1e-30)  # no all-zero row or column
        for _ in range(SINKHORN_ITERATIONS):
            score /= score.sum(dim=1, keepdim=True)
            score /= score.sum(dim=0, keepdim=True)
        return score.to(p.dtype)


class FreshRigL(RigL):
    """RigL that grows only connections inactive before the update."""

    def update_mask(self, p: torch.nn.Parameter, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        self._active_before = mask.clone()
        return super().update_mask(p, mask, sparsity)

    def grow_score(self, p: torch.nn.Parameter) -> torch.Tensor:
        return super().grow_score(p).masked_fill_(self._active_before, -1.0)  # below any |g|
