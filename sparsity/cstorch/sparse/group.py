"""``cstorch.sparse.group``: ``Group``, parameters routed to algorithms by the first filter
that matches (globs are full-name matches where ``*`` crosses dots)."""

from __future__ import annotations

import fnmatch
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .base import SparsityAlgorithm

__all__ = ["Group"]

ParamFilter = Callable[[str, torch.Tensor], bool]


def _glob_filter(globs: list[str]) -> ParamFilter:
    patterns = [re.compile(fnmatch.translate(glob)) for glob in globs]
    return lambda name, _param: any(p.match(name) for p in patterns)


class Group(SparsityAlgorithm):
    @dataclass
    class Filter:
        filter: ParamFilter
        algorithm: SparsityAlgorithm

    def __init__(self, groups: dict[Any, SparsityAlgorithm] | None = None) -> None:
        super().__init__(sparsity=None)
        self._groups: list[Group.Filter] = []
        for group_filter, algorithm in (groups or {}).items():
            self.add(group_filter, algorithm)

    @property
    def sparsity(self) -> Any:
        raise NotImplementedError("a Group has no sparsity of its own; read group[i].sparsity")

    @sparsity.setter
    def sparsity(self, value: Any) -> None:
        if value is not None:
            raise NotImplementedError("a Group has no sparsity of its own; set group[i].sparsity")

    @property
    def num_sparse_params(self) -> int:
        return sum(len(g.algorithm.sparse_params) for g in self._groups)

    def __getitem__(self, index: int) -> SparsityAlgorithm:
        return self._groups[index].algorithm

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, filter: str | list[str] | tuple[str, ...] | ParamFilter, algorithm: SparsityAlgorithm) -> None:  # noqa: A002
        if not isinstance(algorithm, SparsityAlgorithm):
            raise TypeError(f"algorithm must be a SparsityAlgorithm, got {type(algorithm).__name__}")
        if isinstance(algorithm, Group):
            raise TypeError("a Group cannot hold a Group; use extend() to merge groups")
        if isinstance(filter, str):
            filter = [filter]
        if isinstance(filter, (list, tuple)):
            if not all(isinstance(glob, str) for glob in filter):
                raise TypeError(f"param_filter globs must be strings, got {filter!r}")
            filter = _glob_filter(list(filter))
        elif not callable(filter):
            raise TypeError(f"filter must be a glob, a list of globs or a callable, got {type(filter).__name__}")
        self._groups.append(Group.Filter(filter, algorithm))
        self.sparse_params.update(algorithm.sparse_params)

    def extend(self, group: Group) -> None:
        if not isinstance(group, Group):
            raise TypeError(f"group must be a Group, got {type(group).__name__}")
        for entry in group._groups:
            self.add(entry.filter, entry.algorithm)

    def sparsify_parameter(self, module: torch.nn.Module, name: str, param: torch.Tensor | None) -> None:
        if param is None or self.get_sparse_params(param) is not None or getattr(param, "requires_dense", False):
            return
        for entry in self._groups:
            if entry.filter(name, param):
                entry.algorithm.sparsify_parameter(module, name, param)
                self.sparse_params.update(entry.algorithm.sparse_params)
                return

    def sparsify_module(self, module: torch.nn.Module) -> None:
        if not self._groups:
            raise RuntimeError("No groups were added to the Group sparsity algorithm")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # one clearer warning below
            super().sparsify_module(module)
        if self.num_sparse_params == 0:
            warnings.warn("No parameters were sparsified: no param_filter matched a parameter of the module")

    def _forward_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        for entry in self._groups:
            entry.algorithm._forward_pre_hook(module, args)

    def sparsify_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        super().sparsify_optimizer(optimizer)
        for entry in self._groups:
            # the optimizer is sparse already, so no second set of step hooks; RigL still hooks
            # zero_grad to clear its dense gradients
            entry.algorithm.sparsify_optimizer(optimizer)

    def update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        for entry in self._groups:
            entry.algorithm.update(optimizer)

    def register_target_sparsity_hook(self, hook: Callable) -> list:
        return [entry.algorithm.register_target_sparsity_hook(hook) for entry in self._groups]

    def register_computed_sparsity_hook(self, hook: Callable) -> list:
        return [entry.algorithm.register_computed_sparsity_hook(hook) for entry in self._groups]

    def visit_state(self, fn: Callable) -> None:
        for entry in self._groups:
            entry.algorithm.visit_state(fn)

    def state_dict(self) -> list[Any]:
        return [entry.algorithm.state_dict() for entry in self._groups]

    def load_state_dict(self, state_dict: Any) -> None:
        states = [state_dict] if isinstance(state_dict, dict) else list(state_dict)
        if len(states) != len(self._groups):
            raise ValueError(f"Expected a list of {len(self._groups)} state_dicts for the Group but got {len(states)}.")
        for state, entry in zip(states, self._groups):
            entry.algorithm.load_state_dict(state)
