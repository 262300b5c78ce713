"""Mask statistics the reference lacks: churn, ITOP rate, drop and grow counts.

Kept as raw counts so a Group can add its members' counts before turning them into rates.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .keeping import SparseParam

_COUNTS = ("drops", "grows", "active_before", "ever_active", "total")
UNION_SUFFIX = "_union"


class MaskStats:
    """Per-update counts plus the union of every mask seen (for the ITOP rate).

    Each union is a non-persistent buffer ``<param>_mask_union`` beside its mask, so it moves
    with the model (``model.to("cuda")`` after ``apply``) and never enters the model's
    state_dict; the algorithm's ``state_dict`` carries it instead.
    """

    def __init__(self) -> None:
        self._params: dict[str, SparseParam] = {}
        self._loaded: dict[str, torch.Tensor] = {}  # a union restored before its mask exists
        self.last: dict[str, int] = {}

    def track(self, sp: SparseParam) -> None:
        union_name = sp.mask_name + UNION_SUFFIX
        if union_name not in sp.module._buffers:
            sp.module.register_buffer(union_name, sp.mask.clone(), persistent=False)
        self._params[sp.name] = sp
        loaded = self._loaded.pop(sp.name, None)
        if loaded is not None:
            self._union(sp.name).copy_(loaded)

    @property
    def union(self) -> dict[str, torch.Tensor]:
        """Every mask position ever active, by parameter name."""
        return {name: self._union(name) for name in self._params}

    def _union(self, name: str) -> torch.Tensor:
        sp = self._params[name]
        return sp.module._buffers[sp.mask_name + UNION_SUFFIX]

    def record(self, before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> None:
        counts = dict.fromkeys(_COUNTS, 0)
        for name, old in before.items():
            new, union = after[name], self._union(name)
            active_before, stayed = int(torch.count_nonzero(old)), int(torch.count_nonzero(old & new))
            counts["drops"] += active_before - stayed
            counts["grows"] += int(torch.count_nonzero(new)) - stayed
            counts["active_before"] += active_before
            union |= new
            counts["ever_active"] += int(torch.count_nonzero(union))
            counts["total"] += new.numel()
        self.last = counts

    @staticmethod
    def metrics(stats: Iterable[MaskStats]) -> dict[str, float]:
        """``mask/churn`` (fraction of previously active entries dropped), ``mask/itop_rate``
        (|union of all masks so far| / numel), ``mask/drops``, ``mask/grows``; empty before any update."""
        totals = dict.fromkeys(_COUNTS, 0)
        seen = False
        for s in stats:
            if s.last:
                seen = True
                for key in _COUNTS:
                    totals[key] += s.last[key]
        if not seen:
            return {}
        return {
            "mask/churn": totals["drops"] / max(totals["active_before"], 1),
            "mask/itop_rate": totals["ever_active"] / max(totals["total"], 1),
            "mask/drops": float(totals["drops"]),
            "mask/grows": float(totals["grows"]),
        }

    def state_dict(self) -> dict[str, Any]:
        unions = {k: v.clone() for k, v in self._loaded.items()}
        unions.update({k: v.clone() for k, v in self.union.items()})
        return {"union": unions, "last": dict(self.last)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for name, saved in state_dict["union"].items():
            if name in self._params:
                union = self._union(name)
                union.copy_(saved.to(device=union.device, dtype=torch.bool))
            else:
                self._loaded[name] = saved.clone().bool()
        self.last = dict(state_dict["last"])
