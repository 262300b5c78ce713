import torch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsity.masks import (
    FirstTieBreaker,
    InputGroupScoreShaper,
    OutputGroupScoreShaper,
    RandomTieBreaker,
    drop_minimum,
    grow_maximum,
    keep_count,
    topk_mask,
)


def test_keep_count_is_exact_where_float32_truncation_is_not():
    assert keep_count(640, 0.8) == 128  # the reference keeps 127
    assert keep_count(10, 0.0) == 10 and keep_count(10, 1.0) == 0


def test_topk_first_tie_breaker_prefers_low_indices():
    score = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, float("nan")]])
    assert topk_mask(score, 2, FirstTieBreaker()).tolist() == [[False, True, True, False, False, False]]


def test_random_tie_breaker_is_seeded_and_exact():
    score = torch.zeros(1, 1000)
    a = topk_mask(score, 100, RandomTieBreaker(7))
    assert int(a.sum()) == 100
    assert torch.equal(a, topk_mask(score, 100, RandomTieBreaker(7)))
    assert not torch.equal(a, topk_mask(score, 100, RandomTieBreaker(8)))


def full_sort_topk(score: torch.Tensor, k: int) -> torch.Tensor:
    """The obvious implementation: stable sort of the whole row, lowest index first on ties."""
    order = torch.sort(torch.nan_to_num(score, nan=-float("inf")), descending=True, stable=True).indices
    mask = torch.zeros_like(score, dtype=torch.bool)
    mask[order[:k]] = True
    return mask


@pytest.mark.parametrize("n", [7, 1000, 70_000, 300_000])  # the last two take the sampled path
@pytest.mark.parametrize("seed", [0, 1])
def test_selection_equals_a_full_sort(n, seed):
    generator = torch.Generator().manual_seed(seed)
    score = torch.randint(0, 50, (n,), generator=generator).float()  # heavy ties
    score[torch.rand(n, generator=generator) < 0.3] = -float("inf")  # masked-out entries
    score[torch.rand(n, generator=generator) < 0.01] = float("nan")
    for k in {0, 1, n // 100, n // 3, n // 2, n - 1, n}:
        got = topk_mask(score.reshape(1, -1), k, FirstTieBreaker())[0]
        assert int(got.sum()) == k
        assert torch.equal(got, full_sort_topk(score, k)), k


def test_random_ties_are_spread_over_the_tensor():
    chosen = torch.nonzero(topk_mask(torch.zeros(1, 10_000), 1000, RandomTieBreaker(5))[0]).float()
    # A lowest-index rule would pick 0..999 (mean 499.5); a seeded shuffle picks across the range.
    assert 4000 < chosen.mean() < 6000 and chosen.max() > 9000


def test_topk_is_independent_of_thread_count():
    score = torch.randint(0, 4, (1, 50000)).float()  # many ties
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = topk_mask(score, 20000, RandomTieBreaker(3))
        torch.set_num_threads(max(2, old))
        many = topk_mask(score, 20000, RandomTieBreaker(3))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, many)


def test_hand_worked_drop_and_grow():
    # 8 weights, 4 active; drop the 2 smallest |w| among active, grow the 2 largest scores among inactive.
    w = torch.tensor([[0.9, 0.0, 0.1, 0.0, 0.5, 0.0, 0.2, 0.0]]).abs()
    mask = torch.tensor([[True, True, True, False, True, False, False, False]])
    kept = drop_minimum(w, mask, torch.tensor([2]), FirstTieBreaker())
    # active zero at index 1 and 0.1 at index 2 are dropped; inactive zeros are never "kept".
    assert kept.tolist() == [[True, False, False, False, True, False, False, False]]
    grow_score = torch.tensor([[9.0, 5.0, 1.0, 3.0, 9.0, 4.0, 0.0, 2.0]])
    grown = grow_maximum(grow_score, kept, torch.tensor([2]), FirstTieBreaker())
    assert grown.tolist() == [[True, True, False, False, True, True, False, False]]


def test_output_and_input_group_shapers_balance_counts():
    score = torch.arange(24.0).reshape(4, 6)
    out = OutputGroupScoreShaper(2)
    mask = out.unshape(topk_mask(out.shape(score), 3), score.shape)
    assert mask[:2].sum() == 3 and mask[2:].sum() == 3
    inp = InputGroupScoreShaper(3)
    mask = inp.unshape(topk_mask(inp.shape(score), 2), score.shape)
    assert [int(mask[:, 2 * g : 2 * g + 2].sum()) for g in range(3)] == [2, 2, 2]
    assert torch.equal(inp.unshape(inp.shape(score), score.shape), score)


def test_shaper_rejects_indivisible_groups():
    with pytest.raises(ValueError, match="balance_out_groups=3"):
        OutputGroupScoreShaper(3).shape(torch.zeros(4, 4))


def test_apply_mask_on_meta_tensors_does_no_work():
    """A plan builds models of any size on the meta device: masking there must not loop over
    chunks of a 10^10-entry weight (that loop is what kept :validate busy for minutes)."""
    from torch.overrides import TorchFunctionMode

    from sparsity.masks import apply_mask_

    class CountCalls(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            CountCalls.calls += 1
            return func(*args, **(kwargs or {}))

    weight = torch.empty(100_000, 100_000, device="meta")
    mask = torch.empty(100_000, 100_000, dtype=torch.bool, device="meta")
    with CountCalls():
        apply_mask_(mask, weight)
    assert CountCalls.calls < 5
    assert weight.is_meta and weight.shape == (100_000, 100_000)


DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@settings(max_examples=40)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(1, 9), st.integers(1, 9),
                          st.booleans(), st.integers(0, 2 ** 31 - 1)), min_size=1, max_size=6))
def test_masking_many_tensors_in_one_call_is_bit_for_bit_masking_each(tensors):
    """apply_masks_ (one foreach multiply per width, as the sparsity hooks mask a step's
    gradients and states) leaves exactly what apply_mask_ leaves on each tensor: kept bits
    unchanged, +0 where the mask is False, NaN and inf there too; transposed views alike."""
    from sparsity.masks import apply_mask_, apply_masks_

    pairs, expected = [], []
    for dtype, rows, cols, transposed, seed in tensors:
        generator = torch.Generator().manual_seed(seed)
        values = torch.randn(rows, cols, generator=generator).to(dtype)
        values[torch.rand(rows, cols, generator=generator) < 0.2] = float("nan")
        values[torch.rand(rows, cols, generator=generator) < 0.2] = -float("inf")
        mask = torch.rand(rows, cols, generator=generator) < 0.5
        if transposed:
            values, mask = values.t(), mask.t()
        alone = values.clone()
        apply_mask_(mask, alone)
        pairs.append((mask, values))
        expected.append(alone)
    apply_masks_(pairs)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    for (_, values), alone in zip(pairs, expected):
        width = bits[values.element_size()]
        assert torch.equal(values.view(width), alone.view(width))
