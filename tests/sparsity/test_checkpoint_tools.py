"""sparsity.checkpoint: finalize, NaN sentinels, CSR export, resuming at another sparsity level."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import sparsity
from sparsity.checkpoint import export_csr, finalize, load_into_sparse, recover_masks
from sparsity.masks import keep_count

SPARSE = ("fc1.weight", "fc2.weight")


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(OrderedDict(fc1=nn.Linear(8, 16), act=nn.ReLU(), fc2=nn.Linear(16, 6)))


def sparse_checkpoint(level: float = 0.5) -> dict[str, torch.Tensor]:
    """A trained-looking sparse state_dict: masks at ``level``, kept weights non-zero."""
    model = make_model()
    sparsity.Static(sparsity=level, seed=4).apply(model)
    return {key: value.clone() for key, value in model.state_dict().items()}


def sparse_run(level: float, **kwargs: object) -> tuple[nn.Module, sparsity.SparsityAlgorithm]:
    """A fresh model with its own (different) masks, as a restarted job builds it."""
    model = make_model(seed=9)
    algorithm = sparsity.Static(sparsity=level, seed=1, **kwargs)
    algorithm.apply(model)
    return model, algorithm


def kept(state: dict[str, torch.Tensor], name: str) -> int:
    return int(state[name + "_mask"].sum())


# ---------------------------------------------------------------------------------- finalize
def test_finalize_zeros_folds_masks_and_drops_them() -> None:
    checkpoint = sparse_checkpoint()
    checkpoint["fc1.weight"][~checkpoint["fc1.weight_mask"]] = 5.0  # stale values where pruned
    before = {key: value.clone() for key, value in checkpoint.items()}
    final = finalize(checkpoint)
    assert sorted(final) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    for name in SPARSE:
        mask = checkpoint[name + "_mask"]
        assert torch.equal(final[name], checkpoint[name] * mask)
    assert final["fc1.bias"] is checkpoint["fc1.bias"]
    assert all(torch.equal(before[key], checkpoint[key]) for key in before)  # input untouched


def test_finalize_nan_round_trips_through_recover_masks() -> None:
    checkpoint = sparse_checkpoint()
    sentinel = finalize(checkpoint, mode="nan")
    assert not any(key.endswith("_mask") for key in sentinel)
    for name in SPARSE:
        assert torch.equal(torch.isnan(sentinel[name]), ~checkpoint[name + "_mask"])
    recovered = recover_masks(sentinel)
    assert sorted(recovered) == sorted(checkpoint)
    for key, value in checkpoint.items():
        assert recovered[key].dtype == value.dtype
        assert torch.equal(recovered[key], value), key


def test_finalize_zeros_reads_nan_sentinels() -> None:
    checkpoint = sparse_checkpoint()
    from_sentinel = finalize(finalize(checkpoint, mode="nan"), mode="zeros")
    direct = finalize(checkpoint)
    assert list(from_sentinel) == list(direct)
    assert all(torch.equal(from_sentinel[key], direct[key]) for key in direct)


def test_finalize_keeps_bf16() -> None:
    checkpoint = {key: value.to(torch.bfloat16) if value.is_floating_point() else value
                  for key, value in sparse_checkpoint().items()}
    assert finalize(checkpoint, mode="nan")["fc1.weight"].dtype == torch.bfloat16


def test_finalize_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match=r"mode must be one of \['nan', 'zeros'\], got 'inf'"):
        finalize(sparse_checkpoint(), mode="inf")


# -------------------------------------------------------------------------------- export_csr
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("form", ["masks", "nan-sentinel"])
def test_export_csr_rebuilds_the_masked_weight_exactly(form: str) -> None:
    checkpoint = sparse_checkpoint(0.75)
    first_kept = checkpoint["fc2.weight_mask"].nonzero()[0]
    checkpoint["fc2.weight"][tuple(first_kept)] = 0.0  # a kept zero is still a stored entry
    source = checkpoint if form == "masks" else finalize(checkpoint, mode="nan")
    exported = export_csr(source)
    assert sorted(exported) == list(SPARSE)
    for name in SPARSE:
        csr, mask = exported[name], checkpoint[name + "_mask"]
        assert csr["indptr"].dtype == csr["indices"].dtype == torch.int64
        assert csr["values"].numel() == int(mask.sum()) == keep_count(mask.numel(), 0.75)
        assert csr["shape"] == tuple(mask.shape)
        dense = torch.sparse_csr_tensor(
            csr["indptr"], csr["indices"], csr["values"], csr["shape"], check_invariants=True
        ).to_dense()
        assert torch.equal(dense, checkpoint[name] * mask)


def test_export_csr_skips_masked_vectors() -> None:
    model = make_model()
    sparsity.Static(sparsity=0.5, param_filter=["fc1.weight", "fc1.bias"]).apply(model)
    assert sorted(export_csr(model.state_dict())) == ["fc1.weight"]


# -------------------------------------------------------------------------- load_into_sparse
def test_same_level_loads_masks_and_weights_as_saved() -> None:
    checkpoint = sparse_checkpoint(0.5)
    model, algorithm = sparse_run(0.5)
    counts = load_into_sparse(model, checkpoint, algorithm)
    assert counts == {"fc1.weight": {"saved": 64, "loaded": 64}, "fc2.weight": {"saved": 48, "loaded": 48}}
    state = model.state_dict()
    assert all(torch.equal(state[key], checkpoint[key]) for key in checkpoint)


def test_higher_sparsity_prunes_the_smallest_live_weights() -> None:
    checkpoint = sparse_checkpoint(0.5)
    model, algorithm = sparse_run(0.75)
    load_into_sparse(model, checkpoint, algorithm)
    state = model.state_dict()
    for name in SPARSE:
        old, new = checkpoint[name + "_mask"], state[name + "_mask"]
        assert int(new.sum()) == keep_count(new.numel(), 0.75)  # 16×8 → 32, 6×16 → 24
        assert not (new & ~old).any()  # pruned stays pruned
        magnitude = checkpoint[name].abs()
        assert magnitude[new].min() >= magnitude[old & ~new].max()
        assert torch.equal(state[name], checkpoint[name] * new)
        assert torch.equal(model.get_parameter(name).detach(), checkpoint[name] * new)


def test_lower_sparsity_regrows_at_random_with_zero_weights() -> None:
    checkpoint = sparse_checkpoint(0.75)
    model, algorithm = sparse_run(0.25)
    counts = load_into_sparse(model, checkpoint, algorithm)
    state = model.state_dict()
    for name in SPARSE:
        old, new = checkpoint[name + "_mask"], state[name + "_mask"]
        assert counts[name] == {"saved": int(old.sum()), "loaded": keep_count(new.numel(), 0.25)}
        assert int(new.sum()) == keep_count(new.numel(), 0.25)  # 16×8 → 96, 6×16 → 72
        assert not (old & ~new).any()  # every saved weight survives
        assert torch.equal(state[name][old], checkpoint[name][old])
        assert torch.all(state[name][new & ~old] == 0)

    again, algorithm_again = sparse_run(0.25)
    load_into_sparse(again, checkpoint, algorithm_again)
    other_seed, algorithm_other = sparse_run(0.25)
    load_into_sparse(other_seed, checkpoint, algorithm_other, seed=123)
    assert torch.equal(again.state_dict()["fc1.weight_mask"], state["fc1.weight_mask"])  # seeded
    assert not torch.equal(other_seed.state_dict()["fc1.weight_mask"], state["fc1.weight_mask"])


def test_level_follows_the_distribution_per_layer() -> None:
    checkpoint = sparse_checkpoint(0.5)
    model, algorithm = sparse_run(0.7, distribution="erk")
    load_into_sparse(model, checkpoint, algorithm)
    state, targets = model.state_dict(), algorithm.layer_targets(0)
    assert targets["fc1.weight"] != targets["fc2.weight"]
    for name in SPARSE:
        assert kept(state, name) == keep_count(state[name].numel(), targets[name])


def test_dense_checkpoint_needs_allow_dense() -> None:
    dense = make_model().state_dict()
    model, algorithm = sparse_run(0.75)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    expected = r"no masks for sparse parameter\(s\) \['fc1.weight', 'fc2.weight'\].*allow_dense=True"
    with pytest.raises(ValueError, match=expected):
        load_into_sparse(model, dense, algorithm)
    # nothing was loaded
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())

    counts = load_into_sparse(model, dense, algorithm, allow_dense=True)
    state = model.state_dict()
    for name in SPARSE:
        assert counts[name]["saved"] is None
        mask = state[name + "_mask"]
        assert int(mask.sum()) == keep_count(mask.numel(), 0.75)
        magnitude = dense[name].abs()
        assert magnitude[mask].min() >= magnitude[~mask].max()  # the largest weights are kept
        assert torch.equal(state[name], dense[name] * mask)


def test_nan_sentinel_checkpoint_loads_with_its_masks() -> None:
    checkpoint = sparse_checkpoint(0.5)
    model, algorithm = sparse_run(0.5)
    load_into_sparse(model, finalize(checkpoint, mode="nan"), algorithm)
    state = model.state_dict()
    assert all(torch.equal(state[key], checkpoint[key]) for key in checkpoint)


def test_group_targets_per_member() -> None:
    checkpoint = sparse_checkpoint(0.5)
    model = make_model(seed=9)
    group = sparsity.Group(
        {"fc1.weight": sparsity.Static(sparsity=0.75), "fc2.weight": sparsity.Static(sparsity=0.25)}
    )
    group.apply(model)
    load_into_sparse(model, checkpoint, group)
    state = model.state_dict()
    assert kept(state, "fc1.weight") == 32 and kept(state, "fc2.weight") == 72


def test_masks_of_parameters_no_longer_sparse_are_dropped() -> None:
    checkpoint = sparse_checkpoint(0.5)
    model, algorithm = sparse_run(0.5, param_filter="fc2.weight")
    load_into_sparse(model, checkpoint, algorithm)
    state = model.state_dict()
    assert "fc1.weight_mask" not in state
    assert torch.equal(state["fc1.weight"], checkpoint["fc1.weight"])  # dense now, zeros included
    assert torch.equal(state["fc2.weight_mask"], checkpoint["fc2.weight_mask"])
