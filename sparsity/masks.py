"""Mask primitives: exact counts, deterministic top-k, drop-minimum, grow-maximum.

Every selection (top-k, drop-minimum among active entries, grow-maximum among inactive ones)
finds the k-th score among the eligible entries by selection (O(n), no full sort: a fixed
strided sample bounds it, and only the candidates near it are ranked), then breaks ties among the
entries equal to it by a documented rule (lowest index first, or a seeded hash of the index)
instead of by whatever order a multithreaded ``torch.topk`` happens to return. Same seed →
bit-identical masks, whatever the thread count.

Score shapers turn a parameter-shaped score into a 2-D ``[groups, members]`` view so one top-k
runs per group (balanced sparsity per output row group or input column group).
"""

from __future__ import annotations

import functools
import math

from typing import Any

import torch

__all__ = [
    "keep_count",
    "group_keep_counts",
    "count_per_row",
    "apply_mask_",
    "apply_masks_",
    "topk_mask",
    "drop_minimum",
    "keep_top_active",
    "grow_maximum",
    "sinkhorn_scaled",
    "move_to_level",
    "ScoreShaper",
    "ScoreFlattener",
    "OutputGroupScoreShaper",
    "InputGroupScoreShaper",
    "TieBreaker",
    "ScoreTieBreaker",
    "FirstTieBreaker",
    "RandomTieBreaker",
]


def sinkhorn_scaled(score: torch.Tensor, iterations: int = 20) -> torch.Tensor:
    """A non-negative score times a positive factor per output row and per input column, chosen
    (Sinkhorn-Knopp) so that every row sums alike and every column sums alike.

    A weight's |gradient| is a sum over tokens of |δ_i x_j|: its size comes mostly from an outer
    product of a per-row error scale and a per-column input scale, so a top-k on it piles onto
    the same few rows and columns at every update. Dividing those scales out keeps what the
    gradient says about which (row, column) pairs interact; a rank-1 score becomes uniform.
    Weights of more than two dimensions are scaled as ``[out, -1]``. NaN stays NaN.
    """
    if score.dim() < 2:
        return score
    nan = score.isnan()
    work = score.reshape(score.shape[0], -1).nan_to_num(0.0).double() + 1e-30  # no zero line
    col = torch.ones(work.shape[1], dtype=work.dtype, device=work.device)
    for _ in range(iterations):
        # A non-square score has no exact fixed point: row and col drift by a factor per
        # iteration in opposite directions (their product settles) until one overflows. A
        # power-of-two rescale of col before each round keeps both finite; the row computed
        # from it absorbs the inverse power exactly, so no bit of the result changes.
        col = torch.ldexp(col, -torch.frexp(col.max()).exponent)
        row = 1.0 / (work @ col)
        col = 1.0 / (work.T @ row)
    scaled = (work * row[:, None] * col[None, :]).reshape(score.shape).to(score.dtype)
    return scaled.masked_fill_(nan, math.nan)


def keep_count(numel: int, sparsity: float) -> int:
    """Number of entries kept at ``sparsity``: ``numel - round(numel * sparsity)``.

    Computed in float64 and rounded half-to-even, so 80% of 640 keeps exactly 128 (the reference
    truncates a float32 product and keeps 127).

    Args:
        numel: The number of entries.
        sparsity: The fraction to zero, in [0, 1].

    Raises:
        ValueError: ``sparsity`` outside [0, 1] or NaN.
    """
    if not 0.0 <= sparsity <= 1.0 or math.isnan(sparsity):
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity!r}")
    return numel - int(round(numel * float(sparsity)))


def group_keep_counts(keep: int, groups: int, current: list[int] | None = None) -> list[int]:
    """``keep`` entries split over ``groups`` equal groups (balanced sparsity): counts differ by
    at most one and sum to exactly ``keep``, so a balanced layer is at its exact level too.

    The ``keep % groups`` larger counts go to the groups keeping the most entries now
    (``current``; ties: lower index first), so an update moves no more entries than it must
    and the same groups keep the extra one from update to update.
    """
    if groups < 1 or not 0 <= keep:
        raise ValueError(f"need groups >= 1 and keep >= 0, got groups={groups}, keep={keep}")
    base, extra = divmod(keep, groups)
    now = current if current is not None else [0] * groups
    counts = [base] * groups
    for group in sorted(range(groups), key=lambda g: (-now[g], g))[:extra]:
        counts[group] += 1
    return counts


def count_per_row(mask: torch.Tensor) -> torch.Tensor:
    """True entries in each row of a 2-D bool mask (int64). Counted row by row because
    ``count_nonzero`` over a dim first widens the whole mask to int64, 8 bytes an entry."""
    return torch.stack([torch.count_nonzero(row) for row in mask])


# Integer types as wide as each floating type, to multiply bit patterns by 0 or 1.
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The mask is widened to the tensors' integer type a chunk of this many entries at a time: a
# temporary that small is reused by the allocator, where a tensor-sized one (at 10^7 entries)
# would be freshly mapped, page by page, on every call.
_CHUNK = 1 << 20


def apply_mask_(mask: torch.Tensor, *tensors: torch.Tensor) -> None:
    """Zero each tensor in place where the bool ``mask`` (their shape) is False.

    Exact: entries kept are bit-for-bit unchanged and NaN/inf where the mask is False become
    +0. Bit patterns, viewed as same-width integers, are multiplied by the mask's 0/1 values
    (widened once per integer type and shared by the tensors): a vectorised pass with no
    inverted mask, many times faster on CPU than ``masked_fill_``. Parameters are edited in
    place, so call it under ``torch.no_grad()`` for them.
    """
    if mask.is_meta:
        return  # shapes only (a plan of a model of any size): no values to zero, no work to do
    by_type: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        bits = _SAME_WIDTH_INT.get(tensor.element_size()) if tensor.is_floating_point() else None
        if bits is None:
            tensor.masked_fill_(~mask, 0)
        else:
            by_type.setdefault(bits, []).append(tensor.view(bits))
    keep = mask.view(torch.uint8)
    for bits, views in by_type.items():
        if keep.numel() <= _CHUNK or not all(v.is_contiguous() for v in (keep, *views)):
            factor = keep.to(bits)
            for view in views:
                view.mul_(factor)
            continue
        flats = [view.view(-1) for view in views]
        for start in range(0, keep.numel(), _CHUNK):
            factor = keep.view(-1)[start:start + _CHUNK].to(bits)
            for flat in flats:
                flat[start:start + _CHUNK].mul_(factor)


def apply_masks_(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``apply_mask_(mask, tensor)`` for every ``(mask, tensor)`` pair, exactly as it, in as few
    calls as the device allows: one ``torch._foreach_mul_`` of bit patterns by bool masks per
    integer width, which widens each mask inside the multiply (a kernel per tensor on CUDA from
    one call: a training step's masking was one Python-launched kernel pair per tensor, and the
    GPU step is the host's launches). On a CPU, tensors over a chunk of entries go through
    ``apply_mask_``'s chunked pass instead (a CPU multiply widens its bool operand into a
    tensor-sized temporary)."""
    by_type: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for mask, tensor in pairs:
        bits = _SAME_WIDTH_INT.get(tensor.element_size()) if tensor.is_floating_point() else None
        if mask.is_meta or bits is None or (not mask.is_cuda and mask.numel() > _CHUNK):
            apply_mask_(mask, tensor)
            continue
        views, masks = by_type.setdefault(bits, ([], []))
        views.append(tensor.view(bits))
        masks.append(mask)
    for views, masks in by_type.values():
        torch._foreach_mul_(views, masks)


class TieBreaker:
    """Orders equal scores: among ties, the smallest key wins (equal keys: the lower index).

    A subclass written to cstorch 2.0's protocol, ``__call__(score) -> score`` (separating ties
    by small offsets), is honoured: its call transforms the scores before each selection.
    """

    def keys(self, indices: torch.Tensor) -> torch.Tensor:
        """The tie-break key of each index along a row (smaller wins); default: the index."""
        return indices


ScoreTieBreaker = TieBreaker
"""The cstorch blog's name for the tie breakers' base class
([`FirstTieBreaker`][sparsity.FirstTieBreaker], [`RandomTieBreaker`][sparsity.RandomTieBreaker]):
orders equal scores (subclass it, or pass one as an algorithm's ``tie_breaker``)."""


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

    @functools.cached_property
    def _constants(self) -> list[int]:
        """Offset and two multipliers, drawn on first use: most selections have no ties."""
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randint(1, _PRIME, (3,), generator=generator).tolist()

    def keys(self, indices: torch.Tensor) -> torch.Tensor:
        offset, *multipliers = self._constants
        x = (indices.long() + offset) % _PRIME
        for multiplier in multipliers:
            x = (x * multiplier) % _PRIME
            x = x ^ (x >> 16)
        return x


class ScoreShaper:
    """Reshapes a parameter-shaped score into ``[groups, members]`` and back; one count per
    group. cstorch's protocol, ``shaper(tensor) -> (rows, unshape)``, is its call, so the
    shapers below serve ``sparsity.cstorch`` too (``cstorch.sparse.utils`` exports them).

    A subclass written to cstorch's protocol, ``__call__(tensor) -> (rows, unshape)`` and
    nothing else, works as is: ``shape``, ``unshape`` and ``groups`` are derived from its call.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__call__" in cls.__dict__ and "shape" not in cls.__dict__:
            cls.shape = ScoreShaper._shape_by_call  # type: ignore[method-assign]
            cls.unshape = ScoreShaper._unshape_by_call  # type: ignore[method-assign]
            cls.groups = ScoreShaper._groups_by_call  # type: ignore[method-assign]

    def __call__(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """cstorch's protocol: the tensor as rows, and the function that undoes it."""
        return self.shape(tensor), lambda rows: self.unshape(rows, tensor.shape)

    def _shape_by_call(self, score: torch.Tensor) -> torch.Tensor:
        rows, _ = self(score)
        return rows.reshape(1, -1) if rows.dim() == 1 else rows

    def _unshape_by_call(self, grouped: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        rows, unshape = self(torch.empty(shape, dtype=grouped.dtype))
        return unshape(grouped.reshape(rows.shape))

    def _groups_by_call(self, shape: torch.Size) -> int:
        return self._shape_by_call(torch.empty(shape)).shape[0]

    def groups(self, shape: torch.Size) -> int:
        """How many groups (rows of the shaped score) a parameter of ``shape`` has."""
        return 1

    def shape(self, score: torch.Tensor) -> torch.Tensor:
        """``score`` (the parameter's shape) as ``[groups, members]``; each row keeps its own
        count."""
        return score.reshape(1, -1)

    def unshape(self, grouped: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Undoes :meth:`shape`: a ``[groups, members]`` tensor back to ``shape``."""
        return grouped.reshape(shape)


class ScoreFlattener(ScoreShaper):
    """One group: top-k over the whole tensor (cstorch's call gives it flat, as cstorch's)."""

    def __call__(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor.reshape(-1), lambda rows: rows.reshape(tensor.shape)

    shape = ScoreShaper.shape  # its own attribute: the call above is not a protocol-only class's


class OutputGroupScoreShaper(ScoreShaper):
    """``num_groups`` groups of consecutive entries in row-major order: of consecutive output
    rows when ``num_groups`` divides them (e.g. one group per attention head)."""

    def __init__(self, num_groups: int) -> None:
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.num_groups = num_groups

    def groups(self, shape: torch.Size) -> int:
        if math.prod(shape) % self.num_groups:
            raise ValueError(
                f"balance_out_groups={self.num_groups} does not divide the {math.prod(shape)} entries "
                f"of a weight of shape {tuple(shape)}"
            )
        return self.num_groups

    def shape(self, score: torch.Tensor) -> torch.Tensor:
        return score.reshape(self.groups(score.shape), -1)


class InputGroupScoreShaper(ScoreShaper):
    """``num_groups`` groups of consecutive input columns of a 2-D weight, each group laid out
    column by column (cstorch's layout: the transposed weight, row-major)."""

    def __init__(self, num_groups: int) -> None:
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.num_groups = num_groups

    def groups(self, shape: torch.Size) -> int:
        if len(shape) != 2 or math.prod(shape) % self.num_groups:
            raise ValueError(
                f"balance_in_groups={self.num_groups} needs a 2-D weight whose size is divisible "
                f"by it, got shape {tuple(shape)}"
            )
        return self.num_groups

    def shape(self, score: torch.Tensor) -> torch.Tensor:
        return score.t().reshape(self.groups(score.shape), -1)

    def unshape(self, grouped: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        rows, cols = shape
        return grouped.reshape(cols, rows).t().contiguous()


def topk_mask(
    score: torch.Tensor,
    k: int | torch.Tensor,
    tie_breaker: TieBreaker | None = None,
) -> torch.Tensor:
    """Bool mask with exactly ``k`` True entries per row of the 2-D ``score`` (the largest).

    ``k`` is an int or a ``[rows, 1]`` integer tensor. NaN scores rank lowest. Ties follow
    ``tie_breaker`` (default: lowest index first).

    Args:
        score: ``[rows, members]`` scores; flatten a weight's to ``[1, numel]`` for one count
            over the whole tensor.
        k: Entries kept per row.
        tie_breaker: Orders equal scores.

    Raises:
        ValueError: ``score`` is not 2-D.
    """
    if score.dim() != 2:
        raise ValueError(f"topk_mask expects a [groups, members] score, got {tuple(score.shape)}")
    return _select_rows(_ranked(score), k, None, tie_breaker, largest=True)


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

    Only active entries are eligible, so a previously pruned zero can never be kept in place of
    an active zero (reference quirk 6, docs/design.md).
    """
    dropped = _select_rows(_ranked(score), n_drop, mask, tie_breaker, largest=False)
    return dropped.logical_not_().logical_and_(mask)


def grow_maximum(
    score: torch.Tensor,
    mask: torch.Tensor,
    n_grow: torch.Tensor,
    tie_breaker: TieBreaker | None = None,
) -> torch.Tensor:
    """Activate the ``n_grow`` highest-scored *inactive* entries per group (2-D, grouped)."""
    return _select_rows(_ranked(score), n_grow, ~mask, tie_breaker, largest=True).logical_or_(mask)


def _ranked(score: torch.Tensor) -> torch.Tensor:
    """The score as floats that compare: NaN ranks lowest. A sum is NaN if any entry is, so the
    copy that replaces NaN is only made when one may be there."""
    values = score.float()
    return torch.nan_to_num(values, nan=-math.inf) if values.sum().isnan() else values


def _select_rows(
    values: torch.Tensor,
    k: int | torch.Tensor,
    eligible: torch.Tensor | None,
    tie_breaker: TieBreaker | None,
    largest: bool,
) -> torch.Tensor:
    """Per row of the 2-D ``values``, a bool mask of its ``k`` largest (or smallest) entries
    among the ``eligible`` ones (all when None); ``k`` is clamped to the eligible count."""
    counts = [int(k)] * values.shape[0] if isinstance(k, int) else k.reshape(-1).tolist()
    ties = tie_breaker or FirstTieBreaker()
    if callable(ties):  # cstorch's protocol: the scores themselves are made distinct
        values, ties = ties(values).float(), FirstTieBreaker()
    rows = [_select(values[row], count, None if eligible is None else eligible[row], ties, largest)
            for row, count in enumerate(counts)]
    return torch.stack(rows) if len(rows) > 1 else rows[0].unsqueeze(0)


def _select(values: torch.Tensor, k: int, eligible: torch.Tensor | None,
            tie_breaker: TieBreaker, largest: bool) -> torch.Tensor:
    """:func:`_select_rows` for one row; searches whichever end of the order is shorter."""
    n = values.numel()
    n_eligible = n if eligible is None else int(torch.count_nonzero(eligible))
    k = min(max(k, 0), n_eligible)
    if 2 * k <= n_eligible:
        chosen = _extreme(values, k, eligible, n_eligible, tie_breaker, largest)
        return torch.zeros(n, dtype=torch.bool, device=values.device).index_fill_(0, chosen, True)
    # The k largest eligible are all eligible but the n_eligible - k smallest; ties among those
    # go the other way round, so both ends agree on which tied entries win.
    others = _extreme(values, n_eligible - k, eligible, n_eligible, tie_breaker, not largest)
    everyone = (torch.ones(n, dtype=torch.bool, device=values.device) if eligible is None
                else eligible.clone())
    return everyone.index_fill_(0, others, False)


# Above this many entries the k-th value is searched among candidates that a strided sample
# says are near it; the sample is fixed (not random), so the result stays deterministic.
_SAMPLE_ABOVE = 1 << 16
_SAMPLE_SIZE = 4096


def _extreme(values: torch.Tensor, k: int, eligible: torch.Tensor | None, n_eligible: int,
             tie_breaker: TieBreaker, largest: bool) -> torch.Tensor:
    """Positions of the k largest (or smallest) eligible values, k <= n_eligible / 2, in O(n)
    without sorting.

    Ties at the boundary go to the lowest keys when ``largest``, to the highest otherwise.
    Keys come from positions in ``values``, so an entry's rank among ties does not depend on
    which other entries are eligible.
    """
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=values.device)
    n = values.numel()
    index = None  # positions of the candidates in `values`; None: every entry is one
    if n > _SAMPLE_ABOVE:
        sample = values[:: n // _SAMPLE_SIZE]
        if eligible is not None:
            sample = sample[eligible[:: n // _SAMPLE_SIZE]]
        m, p = sample.numel(), k / n_eligible
        # Aim four binomial standard deviations past the sample's own estimate of the k-th.
        j = min(m, math.ceil(p * m + 4 * math.sqrt(m * p * (1 - p)) + 8))
        if m:
            bound = torch.kthvalue(sample, m - j + 1 if largest else j).values
            near = values >= bound if largest else values <= bound
            near = torch.nonzero(near if eligible is None else near & eligible).squeeze(1)
            if near.numel() >= k:  # then the k-th eligible value and all its ties are among them
                index = near
    if index is None and eligible is not None:
        index = torch.nonzero(eligible).squeeze(1)
    candidates = values if index is None else values.index_select(0, index)
    c = candidates.numel()
    threshold = torch.kthvalue(candidates, c - k + 1 if largest else k).values
    chosen = torch.nonzero(candidates >= threshold if largest else candidates <= threshold).squeeze(1)
    if chosen.numel() > k:  # more entries tie with the threshold than are missing: break ties
        better = torch.nonzero(candidates > threshold if largest else candidates < threshold).squeeze(1)
        tied = torch.nonzero(candidates == threshold).squeeze(1)
        keys = tie_breaker.keys(tied if index is None else index.index_select(0, tied))
        order = torch.sort(keys, stable=True, descending=not largest).indices[:k - better.numel()]
        chosen = torch.cat([better, tied.index_select(0, order)])
    return chosen if index is None else index.index_select(0, chosen)


def move_to_level(
    weight: torch.Tensor, mask: torch.Tensor, keep: int, generator: torch.Generator
) -> torch.Tensor:
    """``mask`` changed to keep exactly ``keep`` entries: prune the smallest live ``|weight|`` or
    regrow random pruned positions (drawn from the CPU ``generator``, so any device agrees)."""
    live = int(mask.sum())
    flat_mask = mask.reshape(1, -1)
    if keep < live:
        count = torch.tensor([live - keep], device=mask.device)
        moved = drop_minimum(weight.abs().reshape(1, -1), flat_mask, count)
    elif keep > live:
        score = torch.rand(weight.numel(), generator=generator).to(weight.device).reshape(1, -1)
        moved = grow_maximum(score, flat_mask, torch.tensor([keep - live], device=mask.device))
    else:
        return mask
    return moved.reshape(mask.shape)
