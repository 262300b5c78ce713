"""Mask statistics the reference lacks: churn, ITOP rate, drop and grow counts.

Kept as raw counts so a Group can add its members' counts before turning them into rates.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

_COUNTS = ("drops", "grows", "active_before", "ever_active", "total")


class MaskStats:
    """Per-update counts plus the union of every mask seen (for the ITOP rate)."""

    def __init__(self) -> None:
        self.union: dict[str, torch.Tensor] = {}
        self.last: dict[str, int] = {}

    def track(self, name: str, mask: torch.Tensor) -> None:
        self.union.setdefault(name, mask.clone())

    def record(self, before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> None:
        counts = dict.fromkeys(_COUNTS, 0)
        for name, old in before.items():
            new = after[name]
            active_before, stayed = int(torch.count_nonzero(old)), int(torch.count_nonzero(old & new))
            counts["drops"] += active_before - stayed
            counts["grows"] += int(torch.count_nonzero(new)) - stayed
            counts["active_before"] += active_before
            self.union[name] |= new
            counts["ever_active"] += int(torch.count_nonzero(self.union[name]))
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
        return {"union": {k: v.clone() for k, v in self.union.items()}, "last": dict(self.last)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.union = {k: v.clone().bool() for k, v in state_dict["union"].items()}
        self.last = dict(state_dict["last"])
