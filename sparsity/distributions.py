"""How a global target sparsity is spread over layers: uniform, ER and ERK.

Each function maps ``{name: shape}`` and a global sparsity to ``{name: sparsity}`` such that the
total number of kept weights equals the uniform budget (up to per-layer rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

__all__ = ["uniform", "er", "erk", "DISTRIBUTIONS", "get_distribution"]

Shapes = Mapping[str, Sequence[int]]


def uniform(shapes: Shapes, sparsity: float) -> dict[str, float]:
    return {name: float(sparsity) for name in shapes}


def _scaled_density(shapes: Shapes, sparsity: float, raw: Mapping[str, float]) -> dict[str, float]:
    """Solve ``eps`` so that ``sum(min(1, eps * raw_l) * n_l) = (1 - s) * sum(n_l)``.

    A layer whose density would exceed 1 becomes dense and ``eps`` is re-solved over the rest.
    """
    numel = {name: math.prod(shape) for name, shape in shapes.items()}
    budget = (1.0 - sparsity) * sum(numel.values())
    dense: set[str] = set()
    while True:
        free = [name for name in shapes if name not in dense]
        remaining = budget - sum(numel[name] for name in dense)
        weighted = sum(raw[name] * numel[name] for name in free)
        eps = remaining / weighted if weighted > 0 else 0.0
        overflow = [name for name in free if eps * raw[name] > 1.0]
        if not overflow:
            break
        dense.update(overflow)
    return {name: 0.0 if name in dense else 1.0 - eps * raw[name] for name in shapes}


def er(shapes: Shapes, sparsity: float) -> dict[str, float]:
    """Erdős–Rényi: density ∝ (fan_in + fan_out) / (fan_in · fan_out), kernel dims ignored."""
    raw = {n: (s[0] + s[1]) / (s[0] * s[1]) if len(s) >= 2 else 1.0 for n, s in shapes.items()}
    return _scaled_density(shapes, sparsity, raw)


def erk(shapes: Shapes, sparsity: float) -> dict[str, float]:
    """Erdős–Rényi-Kernel (Evci et al. 2020): density ∝ Σ dims / Π dims."""
    raw = {n: sum(s) / math.prod(s) for n, s in shapes.items()}
    return _scaled_density(shapes, sparsity, raw)


DISTRIBUTIONS: dict[str, Callable[[Shapes, float], dict[str, float]]] = {
    "uniform": uniform,
    "er": er,
    "erk": erk,
}


def get_distribution(name: str) -> Callable[[Shapes, float], dict[str, float]]:
    try:
        return DISTRIBUTIONS[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown distribution {name!r}; known: {sorted(DISTRIBUTIONS)}") from None
