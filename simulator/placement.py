"""Map a sparse layer's CSR rows onto the PE grid and measure the load imbalance of the mask.

Placement rule (an assumption, documented as such): the output rows of a layer are cut into
contiguous blocks of ``ceil(out_features / pe_rows)`` rows, one block per PE row of the wafer;
tokens are split evenly over the PE columns, so the column direction adds no imbalance. A PE
row's work is its non-zeros plus ``zero_cost`` times its skipped zeros (the κ of docs/design.md §3).

The imbalance factor compares the busiest PE row with the busiest PE row of a mask that spreads
the same work perfectly evenly over the rows: ``max_g work_g / (work_fraction · max_g dense_g)``
with ``work_fraction = Σ work / Σ dense``. A dense layer is exactly 1.0, a uniformly random
mask is close to 1, and a mask whose non-zeros sit in a few rows is large. The compute term of
the cost model is multiplied by it, because a layer finishes when its busiest PE does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rows_per_pe_row(out_features: int, pe_rows: int) -> int:
    """Output rows held by one PE row (contiguous blocks, the last one possibly shorter)."""
    if out_features < 1 or pe_rows < 1:
        raise ValueError(f"out_features and pe_rows must be >= 1, got {out_features}, {pe_rows}")
    return -(-out_features // pe_rows)


def pe_row_work(row_nnz: Sequence[int] | torch.Tensor, in_features: int, pe_rows: int,
                zero_cost: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(work, dense work) per PE row for the given non-zeros per output row."""
    counts = torch.as_tensor(row_nnz, dtype=torch.float64).reshape(-1)
    if bool((counts < 0).any()) or bool((counts > in_features).any()):
        raise ValueError(f"row_nnz entries must lie in [0, in_features={in_features}]")
    block = rows_per_pe_row(counts.numel(), pe_rows)
    padded = torch.zeros(-(-counts.numel() // block) * block, dtype=torch.float64)
    padded[: counts.numel()] = counts
    dense_rows = torch.zeros_like(padded)
    dense_rows[: counts.numel()] = float(in_features)
    nnz_per_pe = padded.view(-1, block).sum(1)
    dense_per_pe = dense_rows.view(-1, block).sum(1)
    work = nnz_per_pe + zero_cost * (dense_per_pe - nnz_per_pe)
    return work, dense_per_pe


def imbalance_factor(row_nnz: Sequence[int] | torch.Tensor | None, in_features: int,
                     pe_rows: int, zero_cost: float) -> float:
    """Busiest PE row's work over that of a perfectly even spread of the same work (≥ 1)."""
    if row_nnz is None:
        return 1.0
    if not 0.0 <= zero_cost <= 1.0:
        raise ValueError(f"zero_cost must lie in [0, 1], got {zero_cost}")
    work, dense = pe_row_work(row_nnz, in_features, pe_rows, zero_cost)
    total = float(work.sum())
    if total == 0.0:
        return 1.0
    work_fraction = total / float(dense.sum())
    return max(1.0, float(work.max()) / (work_fraction * float(dense.max())))
