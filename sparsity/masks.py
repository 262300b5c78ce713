"""Mask primitives: exact counts, deterministic top-k, drop-minimum, grow-maximum.

Every selection goes through :func:`topk_mask`, which finds the k-th largest score by selection
(O(n), no full sort) and then breaks ties among the entries equal to it by a documented rule
(lowest index first, or a seeded hash of the index) instead of by whatever order a multithreaded
``torch.topk`` happens to return. Same seed → bit-identical masks, whatever the thread count.

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
    """Orders equal scores: among ties, the smallest key wins (equal keys: the lower index)."""

    def keys(self, indices: torch.Tensor) -> torch.Tensor:
        return indices


class FirstTieBreaker(TieBreaker):
    """Among equal scores the lowest index wins."""


# A prime just below 2**31: products of two residues fit in int64, so the hash never overflows.
_PRIME = 2**31 - 1


class RandomTieBreaker(TieBreaker):
    """Among equal scores a seeded pseudo-random order wins: each index is hashed (two rounds of
    multiply-mod-prime and xor-shift), so ordering t ties costs O(t log t), not a permutation of
    the whole tensor. Same seed → same order on every replica."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        generator = torch.Generator().manual_seed(self.seed)
        self.offset, *self.multipliers = torch.randint(1, _PRIME, (3,), generator=generator).tolist()

    def keys(self, indices: torch.Tensor) -> torch.Tensor:
        x = (indices.long() + self.offset) % _PRIME
        for multiplier in self.multipliers:
            x = (x * multiplier) % _PRIME
            x = x ^ (x >> 16)
        return x


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
    return _top_rows(torch.nan_to_num(score.float(), nan=-math.inf), k, tie_breaker)


def _top_rows(score: torch.Tensor, k: int | torch.Tensor,
              tie_breaker: TieBreaker | None) -> torch.Tensor:
    """:func:`topk_mask` for a float score without NaN."""
    counts = [int(k)] * score.shape[0] if isinstance(k, int) else k.reshape(-1).tolist()
    mask = torch.empty(score.shape, dtype=torch.bool)
    for row, count in enumerate(counts):
        mask[row] = _top_of_row(score[row], count, tie_breaker or FirstTieBreaker())
    return mask


def _top_of_row(values: torch.Tensor, k: int, tie_breaker: TieBreaker) -> torch.Tensor:
    """The ``k`` largest of a 1-D tensor; searches whichever end of the order is shorter."""
    n = values.numel()
    if k <= 0 or k >= n:
        return torch.full((n,), k > 0, dtype=torch.bool)
    if 2 * k <= n:
        return _extreme(values, k, tie_breaker, largest=True)
    # The k largest are all but the n - k smallest; ties among those go the other way round.
    return ~_extreme(values, n - k, tie_breaker, largest=False)


# Above this many entries the k-th value is searched among candidates that a strided sample
# says are near it; the sample is fixed (not random), so the result stays deterministic.
_SAMPLE_ABOVE = 1 << 16
_SAMPLE_SIZE = 4096


def _extreme(values: torch.Tensor, k: int, tie_breaker: TieBreaker, largest: bool) -> torch.Tensor:
    """Mask of the k largest (or smallest) values, 1 <= k <= n/2, in O(n) without sorting.

    Ties at the boundary go to the lowest keys when ``largest``, to the highest otherwise, so
    that ``~_extreme(v, n - k, largest=False)`` picks the same entries as a top-k would.
    """
    n = values.numel()
    index = None  # positions of the candidates in `values`; None: every entry is one
    if n > _SAMPLE_ABOVE:
        sample = values[:: n // _SAMPLE_SIZE]
        m = sample.numel()
        # Aim a few binomial standard deviations past the sample's own estimate of the k-th.
        j = min(m, math.ceil(k / n * m + 4 * math.sqrt(m) + 8))
        bound = torch.kthvalue(sample, m - j + 1 if largest else j).values
        near = torch.nonzero(values >= bound if largest else values <= bound).squeeze(1)
        if near.numel() >= k:  # then the k-th value of all is among them
            index, values = near, values[near]
    c = values.numel()
    threshold = torch.kthvalue(values, c - k + 1 if largest else k).values
    chosen = values > threshold if largest else values < threshold
    tied = torch.nonzero(values == threshold).squeeze(1)
    missing = k - int(torch.count_nonzero(chosen))
    if tied.numel() > missing:
        keys = tie_breaker.keys(tied if index is None else index[tied])
        tied = tied[torch.sort(keys, stable=True, descending=not largest).indices[:missing]]
    chosen[tied] = True
    if index is None:
        return chosen
    mask = torch.zeros(n, dtype=torch.bool)
    mask[index[chosen]] = True
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
    flat = mask.reshape(1, -1)
    n_drop = (torch.count_nonzero(flat) - keep).clamp(min=0)
    return drop_minimum(score.reshape(1, -1), flat, n_drop, tie_breaker).reshape(mask.shape)


def drop_minimum(
    score: torch.Tensor,
    mask: torch.Tensor,
    n_drop: torch.Tensor,
    tie_breaker: TieBreaker | None = None,
) -> torch.Tensor:
    """Deactivate the ``n_drop`` lowest-scored *active* entries per group (2-D, grouped).

    The survivors are chosen among active entries only (the selection never sees inactive ones),
    so a previously pruned zero can never be kept in place of an active zero (reference bug 6).
    Ties are ordered by position among the active entries.
    """
    kept = torch.zeros_like(mask)
    drops = n_drop.reshape(-1).tolist()
    for row in range(mask.shape[0]):
        active = torch.nonzero(mask[row]).squeeze(1)
        survivors = _top_of_row(_finite(score[row, active]), active.numel() - int(drops[row]),
                                tie_breaker or FirstTieBreaker())
        kept[row, active[survivors]] = True
    return kept


def grow_maximum(
    score: torch.Tensor,
    mask: torch.Tensor,
    n_grow: torch.Tensor,
    tie_breaker: TieBreaker | None = None,
) -> torch.Tensor:
    """Activate the ``n_grow`` highest-scored *inactive* entries per group (2-D, grouped)."""
    inactive_score = _finite(score).masked_fill_(mask, -math.inf)
    return mask | _top_rows(inactive_score, n_grow.reshape(-1, 1), tie_breaker)
