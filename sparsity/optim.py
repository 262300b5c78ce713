"""``sparsity.optim.<Name>``: every ``torch.optim`` optimizer, plus ``optimizer.apply(alg)``.

They are the torch classes with one extra method; any plain ``torch.optim`` optimizer works too
through ``alg.apply(optimizer)``.
"""

from __future__ import annotations

import torch

from .base import SparsityAlgorithm


class SparseOptimizerMixin:
    def apply(self, algorithm: SparsityAlgorithm) -> None:
        """Same as ``algorithm.apply(self)``."""
        algorithm.apply(self)


def _subclass(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    cls = type(base.__name__, (SparseOptimizerMixin, base), {"__doc__": f"{base.__name__} with apply(alg)."})
    cls.__module__ = __name__
    return cls


_BASES = [
    getattr(torch.optim, name)
    for name in dir(torch.optim)
    if isinstance(getattr(torch.optim, name), type)
    and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
    and getattr(torch.optim, name) is not torch.optim.Optimizer
]
globals().update({base.__name__: _subclass(base) for base in _BASES})
__all__ = ["SparseOptimizerMixin", *(base.__name__ for base in _BASES)]
