"""Load imbalance of real masks on the PE grid."""

from __future__ import annotations

import pytest
import torch

from simulator.placement import imbalance_factor, pe_row_work, rows_per_pe_row


def test_dense_rows_are_balanced_exactly():
    assert imbalance_factor([768] * 3072, 768, pe_rows=757, zero_cost=0.1) == 1.0
    assert imbalance_factor(None, 768, pe_rows=757, zero_cost=0.1) == 1.0


def test_uniform_random_mask_is_near_one():
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(3072, 768, generator=gen) < 0.1
    factor = imbalance_factor(mask.sum(1), 768, pe_rows=757, zero_cost=0.1)
    assert 1.0 <= factor < 1.15


def test_nonzeros_in_a_few_rows_are_badly_imbalanced():
    mask = torch.zeros(3072, 768, dtype=torch.bool)
    mask[:40] = True  # 40 full rows: about 1.3% density, all on 8 PE rows
    factor = imbalance_factor(mask.sum(1), 768, pe_rows=757, zero_cost=0.1)
    assert factor > 5.0


def test_rows_are_cut_into_contiguous_blocks():
    assert rows_per_pe_row(3072, 757) == 5
    assert rows_per_pe_row(100, 757) == 1
    work, dense = pe_row_work([4, 0, 2, 2, 1], in_features=4, pe_rows=2, zero_cost=0.0)
    assert work.tolist() == [6.0, 3.0] and dense.tolist() == [12.0, 8.0]


def test_bad_row_counts_are_rejected():
    with pytest.raises(ValueError, match="row_nnz"):
        imbalance_factor([5, 1], 4, pe_rows=2, zero_cost=0.1)
    with pytest.raises(ValueError, match="zero_cost"):
        imbalance_factor([1, 1], 4, pe_rows=2, zero_cost=2.0)
