"""Gradual pruning with zero-cost neuroregeneration (Liu et al. 2021, arXiv:2106.10404)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..masks import keep_count, keep_top_active, topk_mask
from ..schedules import Cosine, Cubic, Periodic, make_update_schedule
from .rigl import RigL


class GraNet(RigL):
    """Every update: magnitude-prune to the cubic target s_t first, then RigL drop/regrow.

    ``GraNet(sparsity=0.8, init_sparsity=0.5, update={"freq": 100, "stop": 3000})`` prunes from
    50% (sparse-to-sparse; ``init_sparsity=0`` is dense-to-sparse) to 80% along Zhu & Gupta's cubic
    between ``update.start`` and the last update step. ``pruning="global"`` ranks |w| across all
    its layers (layer levels may differ); ``"layer"`` prunes each layer to the target. The drop
    fraction defaults to the paper's cosine decay from 0.3 over the update window.

    Args:
        sparsity: The final level in [0, 1) (reached at the last update step of the window), or
            a schedule of the step that replaces the cubic one.
        update: The update cadence; with a number as ``sparsity`` it must be
            ``{"freq": f, "start": a, "stop": b}``, whose window the cubic spans.
        init_sparsity: The level at ``update.start``, in [0, 1).
        drop_fraction: As for [`SET`][sparsity.SET]; default the cosine decay above.
        pruning: ``"global"`` or ``"layer"``.
        **kwargs: The options of [`RigL`][sparsity.RigL] and of
            [`SparsityAlgorithm`][sparsity.SparsityAlgorithm].

    Raises:
        ValueError: An unknown ``pruning``; with a number as ``sparsity``, an ``update``
            without ``freq``/``start``/``stop``, a window holding no update step, or a level
            outside [0, 1); or an invalid option of RigL, SET or the base class.
    """

    def __init__(
        self,
        sparsity: Any = None,
        *,
        update: Any = None,
        init_sparsity: float = 0.0,
        drop_fraction: Any = None,
        pruning: str = "global",
        **kwargs: Any,
    ) -> None:
        cadence = make_update_schedule(update)
        if pruning not in ("global", "layer"):
            raise ValueError(f"pruning must be 'global' or 'layer', got {pruning!r}")
        if isinstance(sparsity, (int, float)) and not isinstance(sparsity, bool):
            if not isinstance(cadence, Periodic) or cadence.stop is None:
                raise ValueError("GraNet with a float sparsity needs update={freq, start, stop}")
            last = cadence.start + (cadence.last_step - cadence.start) // cadence.freq * cadence.freq
            if last <= cadence.start:
                raise ValueError(f"GraNet update window {cadence!r} holds no update step")
            for field, level in (("init_sparsity", init_sparsity), ("sparsity", sparsity)):
                if not 0.0 <= float(level) < 1.0:
                    raise ValueError(f"{field} must be in [0, 1), got {level!r}")
            sparsity = Cubic(init_sparsity, sparsity, cadence.start, last, cadence.freq)
        if drop_fraction is None:
            drop_fraction = Cosine(0.3, half_period=cadence.last_step or 1)
        self.pruning = pruning
        super().__init__(sparsity, update=cadence, drop_fraction=drop_fraction, **kwargs)

    def update_targets(self, step: int) -> dict[str, float]:
        targets = self.layer_targets(step)
        if self.pruning == "layer":
            return targets
        budget = sum(keep_count(sp.mask.numel(), targets[sp.name]) for sp in self._params)
        scores = torch.cat(
            [torch.where(sp.mask, sp.param.detach().abs(), -math.inf).reshape(-1) for sp in self._params]
        )
        budget = min(budget, int(torch.isfinite(scores).sum()))
        kept = topk_mask(scores.reshape(1, -1), budget).reshape(-1)
        out, offset = {}, 0
        for sp in self._params:
            n = sp.mask.numel()
            out[sp.name] = 1.0 - int(kept[offset : offset + n].sum()) / n
            offset += n
        return out

    def update_mask(self, p: torch.nn.Parameter, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        keep = keep_count(p.numel(), sparsity)
        pruned = keep_top_active(p.detach().abs(), mask, keep, self.tie_breaker(p))
        return super().update_mask(p, pruned, sparsity)
