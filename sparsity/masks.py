"""Mask primitives: exact counts, deterministic top-k, drop-minimum, grow-maximum.

Every selection goes through :func:`topk_mask`, which ranks scores with a *stable* sort, so ties
are broken by a documented rule (lowest index first, or a seeded permutation) instead of by
whatever order a multithreaded ``torch.topk`` happens to return. Same seed → bit-identical masks,
whatever the thread count.

Score shapers turn a parameter-shaped score into a 2-D ``[groups, members]`` view so one top-k
runs per group (balanced sparsity per output row group or input column group).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "keep_count",
    "topk_mask",
    "drop_minimum",
    "keep_top_active",
    "grow_maximum",
    "ScoreShaper",
    "ScoreFlattener",
    "OutputGroupScoreShaper",
    "InputGroupScoreShaper",
    "TieBreaker",
    "FirstTieBreaker",
    "RandomTieBreaker",
]


def keep_count(numel: int, sparsity: float) -> int:
    """Number of entries kept at ``sparsity``: ``numel - round(numel * sparsity)``.

    Computed in float64 and rounded half-to-even, so 80% of 640 keeps exactly 128 (the reference
    truncates a float32 product and keeps 127).
    """
    if not 0.0 <= sparsity <= 1.0 or math.isnan(sparsity):
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity!r}")
    return numel - int(round(numel * float(sparsity)))


class TieBreaker:
    """Orders equal scores. Subclasses return a permutation of ``range(n)`` (or None = identity)."""

    def permutation(self, n: int) -> torch.Tensor | None:
        return None


class FirstTieBreaker(TieBreaker):
    """Among equal scores the lowest flat index wins."""


class RandomTieBreaker(TieBreaker):
    """Among equal scores a seeded random order wins; same seed → same order on every replica."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)

    def permutation(self, n: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randperm(n, generator=generator)


class ScoreShaper:
    """Reshapes a parameter-shaped score into ``[groups, members]`` and back."""

    def groups(self, shape: torch.Size) -> int:
        return 1

    def shape(self, score: torch.Tensor) -> torch.Tensor:
        return score.reshape(1, -1)

    def unshape(self, grouped: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return grouped.reshape(shape)


class ScoreFlattener(ScoreShaper):
    """One group: top-k over the whole tensor."""


class OutputGroupScoreShaper(ScoreShaper):
    """``num_groups`` groups of consecutive output rows (e.g. one per attention head)."""

    def __init__(self, num_groups: int) -> None:
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.num_groups = num_groups

    def groups(self, shape: torch.Size) -> int:
        if shape[0] % self.num_groups:
            raise ValueError(
                f"balance_out_groups={self.num_groups} does not divide the {shape[0]} output rows"
            )
        return self.num_groups

    def shape(self, score: torch.Tensor) -> torch.Tensor:
        return score.reshape(self.groups(score.shape), -1)


class InputGroupScoreShaper(ScoreShaper):
    """``num_groups`` groups of consecutive input columns of a 2-D weight."""

    def __init__(self, num_groups: int) -> None:
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.num_groups = num_groups

    def groups(self, shape: torch.Size) -> int:
        if len(shape) != 2 or shape[1] % self.num_groups:
            raise ValueError(
                f"balance_in_groups={self.num_groups} needs a 2-D weight whose input size is "
                f"divisible by it, got shape {tuple(shape)}"
            )
        return self.num_groups

    def shape(self, score: torch.Tensor) -> torch.Tensor:
        rows, cols = score.shape
        g = self.groups(score.shape)
        # [rows, g, cols/g] -> [g, rows * cols/g]: each group is a block of columns.
        return score.reshape(rows, g, cols // g).permute(1, 0, 2).reshape(g, -1)

    def unshape(self, grouped: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        rows, cols = shape
        g = self.num_groups
        return grouped.reshape(g, rows, cols // g).permute(1, 0, 2).reshape(rows, cols)


def topk_mask(
    score: torch.Tensor,
    k: int | torch.Tensor,
    tie_breaker: TieBreaker | None = None,
) -> torch.Tensor:
    """Bool mask with exactly ``k`` True entries per row of the 2-D ``score`` (the largest).

    ``k`` is an int or a ``[rows, 1]`` integer tensor. NaN scores rank lowest. Ties follow
    ``tie_breaker`` (default: lowest index first).
    """
    if score.dim() != 2:
        raise ValueError(f"topk_mask expects a [groups, members] score, got {tuple(score.shape)}")
    score = torch.nan_to_num(score.float(), nan=-math.inf)
    perm = (tie_breaker or FirstTieBreaker()).permutation(score.shape[1])
    if perm is not None:
        score = score[:, perm]
    order = torch.sort(score, dim=1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    positions = torch.arange(score.shape[1]).expand_as(order)
    ranks.scatter_(1, order, positions)
    mask = ranks < (k if isinstance(k, int) else k.reshape(-1, 1))
    if perm is not None:
        unpermuted = torch.empty_like(mask)
        unpermuted[:, perm] = mask
        mask = unpermuted
    return mask


def _finite(score: torch.Tensor) -> torch.Tensor:
    """Score as float32 with NaN/inf mapped into the finite range, so -inf marks ineligibility."""
    big = torch.finfo(torch.float32).max
    return torch.nan_to_num(score.float(), nan=-big, posinf=big, neginf=-big)


def keep_top_active(
    score: torch.Tensor, mask: torch.Tensor, keep: int, tie_breaker: TieBreaker | None = None
) -> torch.Tensor:
    """Magnitude-style pruning: the ``keep`` highest-scored active entries of a parameter-shaped
    ``mask`` (fewer if fewer are active); inactive entries never return."""
    keep = min(keep, int(mask.sum()))
    eligible = torch.where(mask, _finite(score), -math.inf).reshape(1, -1)
    return topk_mask(eligible, keep, tie_breaker).reshape(mask.shape)


def drop_minimum(
    score: torch.Tensor,
    mask: torch.Tensor,
    n_drop: torch.Tensor,
    tie_breaker: TieBreaker | None = None,
) -> torch.Tensor:
    """Deactivate the ``n_drop`` lowest-scored *active* entries per group (2-D, grouped).

    The survivors are the top ``nnz - n_drop`` among active entries only (inactive ones score
    -inf and every active score is finite), so a previously pruned zero can never be kept in place
    of an active zero (reference bug 6).
    """
    active_score = torch.where(mask, _finite(score), -math.inf)
    n_keep = mask.sum(dim=1, keepdim=True) - n_drop.reshape(-1, 1)
    return topk_mask(active_score, n_keep, tie_breaker) & mask


def grow_maximum(
    score: torch.Tensor,
    mask: torch.Tensor,
    n_grow: torch.Tensor,
    tie_breaker: TieBreaker | None = None,
) -> torch.Tensor:
    """Activate the ``n_grow`` highest-scored *inactive* entries per group (2-D, grouped)."""
    inactive_score = torch.where(mask, -math.inf, _finite(score))
    return mask | topk_mask(inactive_score, n_grow.reshape(-1, 1), tie_breaker)
