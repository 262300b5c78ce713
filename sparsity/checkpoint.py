"""Checkpoint tools: finalize, recover masks, export CSR, and resume at a different sparsity level.

Two on-disk forms of a sparse weight are understood everywhere here:

- ours: the weight (exactly 0 where pruned) plus a bool ``<key>_mask`` entry (True = kept);
- cstorch's NaN sentinel: the weight alone, NaN at every pruned position. A floating weight with
  no ``_mask`` entry that contains NaN is read as this form, so a weight that diverged to NaN at a
  kept position would be misread; check training before converting such a checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sparsity.base import SparsityAlgorithm
from sparsity.group import Group
from sparsity.masks import keep_count, move_to_level, topk_mask

__all__ = ["MASK_SUFFIX", "finalize", "recover_masks", "export_csr", "load_into_sparse"]

MASK_SUFFIX = "_mask"
_FILL = {"zeros": 0.0, "nan": float("nan")}


def _masks(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Weight key → bool mask, from ``<key>_mask`` entries or, failing those, NaN sentinels."""
    masks = {
        key[: -len(MASK_SUFFIX)]: value.bool()
        for key, value in state_dict.items()
        if key.endswith(MASK_SUFFIX) and key[: -len(MASK_SUFFIX)] in state_dict
    }
    for key, value in state_dict.items():
        if key not in masks and _has_nan(value):
            masks[key] = ~torch.isnan(value)
    return masks


def _has_nan(value: Any) -> bool:
    return torch.is_tensor(value) and value.is_floating_point() and bool(torch.isnan(value).any())


def _is_mask_key(key: str, masks: Mapping[str, torch.Tensor]) -> bool:
    return key.endswith(MASK_SUFFIX) and key[: -len(MASK_SUFFIX)] in masks


def finalize(state_dict: Mapping[str, Any], *, mode: str = "zeros") -> dict[str, Any]:
    """A mask-free copy of ``state_dict`` for inference or for cstorch tools.

    ``mode="zeros"``: pruned positions hold 0 (the masks folded in, ``weight * mask``).
    ``mode="nan"``: pruned positions hold NaN, cstorch's sparse checkpoint form
    (:func:`recover_masks` undoes it). Either input form is accepted; ``_mask`` entries are dropped,
    other entries are passed through unchanged, and the input is not modified.
    """
    if mode not in _FILL:
        raise ValueError(f"mode must be one of {sorted(_FILL)}, got {mode!r}")
    masks = _masks(state_dict)
    finalized = {}
    for key, value in state_dict.items():
        if _is_mask_key(key, masks):
            continue
        if key in masks:
            if not value.is_floating_point():
                raise ValueError(f"{key}: only floating weights can be finalized, got {value.dtype}")
            value = torch.where(masks[key], value, _FILL[mode])
        finalized[key] = value
    return finalized


def recover_masks(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Turns NaN-sentinel weights into our form: NaN → 0, plus a bool ``<key>_mask`` after each.

    Weights that already have a ``_mask`` entry, and weights without NaN, are passed through.
    """
    recovered = {}
    for key, value in state_dict.items():
        recovered[key] = value
        mask_key = key + MASK_SUFFIX
        if mask_key not in state_dict and _has_nan(value):
            mask = ~torch.isnan(value)
            recovered[key] = torch.where(mask, value, 0.0)
            recovered[mask_key] = mask
    return recovered


def export_csr(state_dict: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Every masked 2-D weight in CSR form: ``indptr`` (int64, rows + 1), ``indices`` (int64
    column of each kept entry, row-major), ``values`` (the weight at kept positions only, its dtype)
    and ``shape`` ``(rows, cols)``. A kept weight that happens to be 0 is still stored."""
    exported = {}
    for key, mask in _masks(state_dict).items():
        if mask.dim() != 2:
            continue
        weight = state_dict[key]
        indptr = torch.zeros(mask.shape[0] + 1, dtype=torch.int64)
        indptr[1:] = torch.cumsum(mask.sum(dim=1), dim=0)
        exported[key] = {
            "indptr": indptr,
            "indices": mask.nonzero()[:, 1].to(torch.int64),
            "values": weight[mask].detach().clone(),
            "shape": tuple(mask.shape),
        }
    return exported


def load_into_sparse(
    model: torch.nn.Module,
    state_dict: Mapping[str, Any],
    algorithm: SparsityAlgorithm,
    *,
    allow_dense: bool = False,
    seed: int | None = None,
) -> dict[str, dict[str, int | None]]:
    """Loads ``state_dict`` into a model the sparsity ``algorithm`` was applied to, moving every
    sparse parameter to the algorithm's current target (docs/design.md §2, "changing sparsity across a
    restart"). Counts are exact: ``keep_count(numel, target)`` of the layer's target.

    - Same level: masks and weights load as saved.
    - Higher sparsity: previously pruned weights stay pruned; the smallest-magnitude live weights
      are pruned (ties: lowest index first).
    - Lower sparsity: previously pruned positions are regrown uniformly at random (a generator
      seeded with ``seed``, default the algorithm's (a Group's first member's) seed), with weight 0.
    - No mask saved for a sparse parameter (a dense checkpoint): ValueError, unless
      ``allow_dense=True``; then its mask keeps the largest-magnitude weights.
    - A saved mask of a parameter the algorithm no longer claims is dropped: that parameter
      trains dense again, starting from its saved (zero-filled) weights.

    NaN-sentinel checkpoints are read through :func:`recover_masks`. Nothing is loaded when a
    check fails; otherwise the model loads strictly. Balanced groups (``balance_*_groups``) are
    not rebalanced here; the algorithm's next update does that.
    Returns, per sparse parameter, the kept counts ``{"saved": int | None, "loaded": int}``.
    """
    checkpoint = recover_masks(state_dict)
    members = algorithm.members if isinstance(algorithm, Group) else [algorithm]
    targets = {name: level for m in members for name, level in m.layer_targets(m.step).items()}
    names = [name for name, _, _ in algorithm.sparse_parameters()]
    absent = [name for name in names if name not in checkpoint]
    if absent:
        raise ValueError(f"the checkpoint has no entry for sparse parameter(s) {absent}")
    dense = [name for name in names if name + MASK_SUFFIX not in checkpoint]
    if dense and not allow_dense:
        raise ValueError(
            f"the checkpoint has no masks for sparse parameter(s) {dense}: it is dense. "
            "Pass allow_dense=True to initialise masks from the weights by magnitude."
        )
    model_keys = model.state_dict().keys()
    for key in [k for k in checkpoint if k.endswith(MASK_SUFFIX) and k not in model_keys]:
        if key[: -len(MASK_SUFFIX)] in checkpoint:
            del checkpoint[key]
    generator = torch.Generator().manual_seed(members[0].seed if seed is None else int(seed))
    counts: dict[str, dict[str, int | None]] = {}
    for name in names:
        weight, saved = checkpoint[name], checkpoint.get(name + MASK_SUFFIX)
        keep = keep_count(weight.numel(), targets[name])
        if saved is None:
            mask = topk_mask(weight.abs().reshape(1, -1), keep).reshape(weight.shape)
        else:
            mask = move_to_level(weight, saved.bool(), keep, generator)
        checkpoint[name] = torch.where(mask, weight, 0.0)
        checkpoint[name + MASK_SUFFIX] = mask
        counts[name] = {"saved": None if saved is None else int(saved.sum()), "loaded": keep}
    model.load_state_dict(checkpoint)
    return counts

