"""Rigging the Lottery (Evci et al. 2020, arXiv:1911.11134)."""

from __future__ import annotations

from typing import Any

import torch

from ..masks import InputGroupScoreShaper, OutputGroupScoreShaper, sinkhorn_scaled
from .set import SET

GROW_SCORE_SCALINGS = (None, "sinkhorn")


class RigL(SET):
    """SET with growth by the largest |dense gradient| of the masked weight.

    The dense gradient is captured before masking on update steps only (summed over the
    micro-batches since zero_grad, all-reduced first under data parallelism). The paper's cosine
    drop fraction: ``drop_fraction={"type": "cosine", "init": 0.3, "half_period": T_end}``.
    ``balance_out_groups=n`` / ``balance_in_groups=n`` keep an equal count per group of rows /
    columns (e.g. per attention head). ``grow_score_scaling="sinkhorn"`` (not in the paper or
    cstorch) grows by the |gradient| rescaled to equal row and column sums
    (:func:`sparsity.masks.sinkhorn_scaled`), so growth does not pile onto the rows and columns
    with the largest error and input scales (docs/results.md, "Why RigL trailed Static").

    Args:
        sparsity: As for [`SparsityAlgorithm`][sparsity.SparsityAlgorithm].
        update: The update cadence, as for
            [`DynamicSparsityAlgorithm`][sparsity.DynamicSparsityAlgorithm].
        drop_fraction: As for [`SET`][sparsity.SET].
        balance_in_groups: Grow and drop an equal count in each of this many groups of input
            columns.
        balance_out_groups: Grow and drop an equal count in each of this many groups of output
            rows (e.g. one per attention head).
        grow_score_scaling: ``None`` (the paper's |gradient|) or ``"sinkhorn"``.
        **kwargs: The options of [`SET`][sparsity.SET] (``grow_init``, ``score_shaper``) and
            of [`SparsityAlgorithm`][sparsity.SparsityAlgorithm].

    Raises:
        ValueError: A group count that is not a positive int, both group counts, a group count
            with a ``score_shaper``, an unknown ``grow_score_scaling``, or an invalid option of
            SET or the base class.
    """

    grows_by_gradient = True

    def __init__(
        self,
        sparsity: Any = None,
        *,
        update: Any = None,
        drop_fraction: Any = 0.3,
        balance_in_groups: int | None = None,
        balance_out_groups: int | None = None,
        grow_score_scaling: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(sparsity, update=update, drop_fraction=drop_fraction, **kwargs)
        for field, value in (("balance_in_groups", balance_in_groups), ("balance_out_groups", balance_out_groups)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if balance_in_groups and balance_out_groups:
            raise ValueError("set at most one of balance_in_groups and balance_out_groups")
        if (balance_in_groups or balance_out_groups) and kwargs.get("score_shaper") is not None:
            raise ValueError("give either score_shaper or balance_in_groups / balance_out_groups")
        if grow_score_scaling not in GROW_SCORE_SCALINGS:
            raise ValueError(f"grow_score_scaling must be one of {GROW_SCORE_SCALINGS}, "
                             f"got {grow_score_scaling!r}")
        self.grow_score_scaling = grow_score_scaling
        if balance_out_groups:
            self.shaper = OutputGroupScoreShaper(balance_out_groups)
        elif balance_in_groups:
            self.shaper = InputGroupScoreShaper(balance_in_groups)

    def grow_score(self, p: torch.nn.Parameter) -> torch.Tensor:
        # In place: the captured copy exists for this update only, and a second tensor of the
        # parameter's size would cost a fresh allocation.
        score = self.dense_grad(p).abs_()
        return sinkhorn_scaled(score) if self.grow_score_scaling == "sinkhorn" else score
