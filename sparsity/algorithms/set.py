"""Sparse Evolutionary Training (Mocanu et al. 2018, arXiv:1707.04780)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..base import DynamicSparsityAlgorithm, SparseParam
from ..masks import (ScoreFlattener, ScoreShaper, count_per_row, drop_minimum, group_keep_counts,
                     grow_maximum, keep_count)
from ..schedules import make_schedule


GROW_INITS = ("zeros", "random_normal", "initial_dist")


class SET(DynamicSparsityAlgorithm):
    """Each update drops ``floor(df · nnz)`` smallest |w| among active entries and grows as many
    uniformly at random among inactive ones (just-dropped allowed).

    An entry dropped and grown back in the same update keeps its weight and optimizer state
    (RigL's reference code: new connections are those grown *and* inactive before). Entries
    grown from inactive start with zero optimizer state and the weight ``grow_init`` says, as
    in RigL's reference code: ``"zeros"`` (default), ``"random_normal"`` (normal with the
    standard deviation of the layer's weights kept by the update) or ``"initial_dist"`` (values
    drawn from the layer's weights as they were when the algorithm was applied, shuffled).

    When the target level moves between updates the extra difference is dropped (or grown) in
    the same update, so nnz equals the scheduled target after every update (reference quirk 5, docs/design.md).

    Args:
        sparsity: As for [`SparsityAlgorithm`][sparsity.SparsityAlgorithm].
        update: The update cadence, as for
            [`DynamicSparsityAlgorithm`][sparsity.DynamicSparsityAlgorithm].
        drop_fraction: The fraction of active entries dropped (and regrown) per update: a
            number in [0, 1] or a schedule of the step (e.g. ``{"type": "cosine", ...}``).
        grow_init: The weight of an entry grown from inactive: ``"zeros"``,
            ``"random_normal"`` or ``"initial_dist"``.
        score_shaper: Reshapes drop and grow scores, e.g. an
            [`OutputGroupScoreShaper`][sparsity.OutputGroupScoreShaper] for an equal count per
            group of rows.
        **kwargs: The options of [`SparsityAlgorithm`][sparsity.SparsityAlgorithm].

    Raises:
        ValueError: An unknown ``grow_init``, a ``score_shaper`` that is not a
            [`ScoreShaper`][sparsity.ScoreShaper], or an invalid base option.
    """

    def __init__(self, sparsity: Any = None, *, update: Any = None, drop_fraction: Any = 0.3,
                 grow_init: str = "zeros", score_shaper: ScoreShaper | None = None, **kwargs: Any) -> None:
        if grow_init not in GROW_INITS:
            raise ValueError(f"grow_init must be one of {list(GROW_INITS)}, got {grow_init!r}")
        if score_shaper is not None and not isinstance(score_shaper, ScoreShaper):
            raise ValueError(f"score_shaper must be a sparsity.ScoreShaper, got {score_shaper!r}")
        super().__init__(sparsity, update=update, **kwargs)
        # a cycling drop fraction counts the updates before the step (cstorch's count)
        self.drop_fraction = make_schedule(drop_fraction, cadence=self.update_schedule, first=1)
        # drop and grow compete within each group the shaper makes (one group: the whole tensor)
        self.shaper: ScoreShaper = score_shaper or ScoreFlattener()
        self.grow_init = grow_init
        self._initial_values: dict[str, torch.Tensor] = {}

    def drop_score(self, p: torch.nn.Parameter) -> torch.Tensor:
        return p.detach().abs()

    def grow_score(self, p: torch.nn.Parameter) -> torch.Tensor:
        # Drawn on the CPU's generator wherever p lives: the same scores, so the same masks, on
        # a GPU replica as on a CPU one.
        return torch.rand(p.shape, generator=self.generator(p)).to(p.device)

    def update_mask(self, p: torch.nn.Parameter, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        fraction = self.drop_fraction.value_at(self.step, True)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"drop_fraction must be in [0, 1] at step {self.step}, got {fraction!r}")
        grouped = self.shaper.shape(mask)
        nnz = count_per_row(grouped).tolist()
        # the layer's exact count, split over the groups (one group: the whole tensor)
        targets = group_keep_counts(keep_count(mask.numel(), sparsity), len(nnz), nnz)
        n_drop = [min(math.floor(fraction * n) + max(n - t, 0), n) for n, t in zip(nnz, targets)]
        ties = self.tie_breaker(p)
        kept = drop_minimum(self.shaper.shape(self.drop_score(p)), grouped, torch.tensor(n_drop), ties)
        # drop_minimum drops exactly n_drop per group, so what is left needs no counting
        n_grow = torch.tensor([t - (n - d) for n, d, t in zip(nnz, n_drop, targets)])
        grown = grow_maximum(self.shaper.shape(self.grow_score(p)), kept, n_grow, ties)
        return self.shaper.unshape(grown, mask.shape)

    def _before_first_mask(self, params: list[SparseParam]) -> None:
        if self.grow_init == "initial_dist":  # loaded by load_state_dict on a resume
            self._initial_values = {sp.name: sp.param.detach().clone() for sp in params}

    @torch.no_grad()
    def initialize_grown(self, p: torch.nn.Parameter, grown: torch.Tensor, old_mask: torch.Tensor) -> None:
        if self.grow_init == "zeros" or not bool(grown.any()):
            return
        name = self._name_of(p)
        generator = self.generator(name, purpose="grow_init")
        if self.grow_init == "random_normal":
            kept = p.detach()[old_mask & self.sparse_params[name].mask]
            std = float(kept.float().std()) if kept.numel() > 1 else 0.0
            values = torch.randn(p.shape, generator=generator) * std
        else:
            initial = self._initial_values[name].reshape(-1)
            values = initial[torch.randperm(initial.numel(), generator=generator)].reshape(p.shape)
        p.copy_(torch.where(grown, values.to(device=p.device, dtype=p.dtype), p))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._initial_values:
            state["initial_values"] = {name: value.clone() for name, value in self._initial_values.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        initial = state.pop("initial_values", None)
        super().load_state_dict(state)
        if initial is not None:
            self._initial_values = {name: value.clone() for name, value in initial.items()}


