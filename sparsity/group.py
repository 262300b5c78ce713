"""Different algorithms for different parameters; the first matching group claims a parameter."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .base import SparsityAlgorithm
from .filters import FirstMatch, ParamFilter
from .stats import MaskStats

GroupKey = str | Iterable[str] | ParamFilter


class Group(SparsityAlgorithm):
    """``Group({"fc1.*": Static(sparsity=0.3), "fc2.*": SET(sparsity=0.9, ...)})``, or an empty
    ``Group()`` filled with :meth:`add` before it is applied.

    Keys are fnmatch globs (full names), lists of globs, or callables ``(name, param) -> bool``;
    they replace the members' own filters. A parameter goes to the first group whose key matches
    it; unmatched parameters stay dense. Each member counts the optimizer's steps itself.

    Args:
        groups: ``{key: algorithm}`` or ``(key, algorithm)`` pairs, in matching order.

    Raises:
        ValueError: A member that is not an algorithm, or is itself a Group.
    """

    registered = False

    def __init__(
        self,
        groups: Mapping[Any, SparsityAlgorithm] | Iterable[tuple[GroupKey, SparsityAlgorithm]] = (),
    ) -> None:
        self.members: list[SparsityAlgorithm] = []
        self._routes = FirstMatch()
        for key, algorithm in groups.items() if isinstance(groups, Mapping) else groups:
            self.add(key, algorithm)

    def add(self, key: GroupKey, algorithm: SparsityAlgorithm) -> None:
        """Appends a group: the parameters ``key`` matches that no earlier group has claimed."""
        if not isinstance(algorithm, SparsityAlgorithm) or isinstance(algorithm, Group):
            raise ValueError(f"group {key!r} must map to a (non-Group) SparsityAlgorithm, got {algorithm!r}")
        algorithm.param_filter = self._routes.add(key, algorithm)
        self.members.append(algorithm)

    # Group state lives in its members; these delegate.
    @property
    def step(self) -> int:
        return self.members[0].step

    @property
    def autoupdate(self) -> bool:
        return all(m.autoupdate for m in self.members)

    @autoupdate.setter
    def autoupdate(self, value: bool) -> None:
        for member in self.members:
            member.autoupdate = value

    def apply(self, obj: nn.Module | torch.optim.Optimizer) -> None:
        if not self.members:
            raise ValueError("this Group has no groups; add one with group.add(filter, algorithm)")
        for member in self.members:
            member.apply(obj)

    def update(self) -> None:
        for member in self.members:
            member.update()

    def layer_targets(self, step: int) -> dict[str, float]:
        return {name: level for member in self.members for name, level in member.layer_targets(step).items()}

    def is_update_step(self, step: int) -> bool:
        return any(m.is_update_step(step) for m in self.members)

    def needs_dense_grad(self) -> bool:
        return any(m.needs_dense_grad() for m in self.members)

    def mask_gradients(self) -> None:
        for member in self.members:
            member.mask_gradients()

    def captured_dense_grads(self) -> list[torch.Tensor]:
        return [grad for member in self.members for grad in member.captured_dense_grads()]

    def mask_weights(self) -> None:
        for member in self.members:
            member.mask_weights()

    @property
    def sparse_params(self) -> dict[str, Any]:
        return {name: sp for member in self.members for name, sp in member.sparse_params.items()}

    def sparse_parameters(self) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        return [entry for member in self.members for entry in member.sparse_parameters()]

    def register_target_sparsity_hook(self, hook: Callable) -> RemovableHandle:
        return _CombinedHandle([m.register_target_sparsity_hook(hook) for m in self.members])

    def register_computed_sparsity_hook(self, hook: Callable) -> RemovableHandle:
        return _CombinedHandle([m.register_computed_sparsity_hook(hook) for m in self.members])

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for member in self.members:
            member_metrics = member.metrics()
            out.update({k: v for k, v in member_metrics.items() if k.startswith("sparsity/") and k != "sparsity/global"})
        entries = self.sparse_parameters()
        total = sum(mask.numel() for _, _, mask in entries)
        if total:
            out["sparsity/global"] = 1.0 - sum(int(torch.count_nonzero(mask)) for _, _, mask in entries) / total
        out.update(MaskStats.metrics(m.stats for m in self.members))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"algorithm": "group", "members": [m.state_dict() for m in self.members]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        members = list(dict(state_dict).get("members", []))
        if len(members) != len(self.members):
            raise ValueError(f"state_dict has {len(members)} groups, this Group has {len(self.members)}")
        for member, state in zip(self.members, members):
            member.load_state_dict(state)

    def __repr__(self) -> str:
        return f"Group({self.members!r})"


class _CombinedHandle(RemovableHandle):
    """One handle that removes a hook from every member."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def __exit__(self, *args: object) -> None:
        self.remove()
