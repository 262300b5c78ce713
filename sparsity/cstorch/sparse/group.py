"""``cstorch.sparse.group``: ``Group``, parameters routed to algorithms by the first filter
that matches (the engine's routing, :class:`sparsity.filters.FirstMatch`: globs are
full-name matches where ``*`` crosses dots)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ...filters import FirstMatch, ParamFilter
from .base import SparsityAlgorithm

__all__ = ["Group"]


class Group(SparsityAlgorithm):
    def __init__(self, groups: dict[Any, SparsityAlgorithm] | None = None) -> None:
        super().__init__(sparsity=None)
        self._routes = FirstMatch()
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
    def algorithms(self) -> list[SparsityAlgorithm]:
        """The groups' algorithms, in matching order."""
        return self._routes.targets()

    @property
    def num_sparse_params(self) -> int:
        return sum(len(algorithm.sparse_params) for algorithm in self.algorithms)

    def __getitem__(self, index: int) -> SparsityAlgorithm:
        return self.algorithms[index]

    def __len__(self) -> int:
        return len(self._routes.routes)

    def add(self, filter: str | list[str] | tuple[str, ...] | ParamFilter, algorithm: SparsityAlgorithm) -> None:  # noqa: A002
        if not isinstance(algorithm, SparsityAlgorithm):
            raise TypeError(f"algorithm must be a SparsityAlgorithm, got {type(algorithm).__name__}")
        if isinstance(algorithm, Group):
            raise TypeError("a Group cannot hold a Group; use extend() to merge groups")
        if filter is None:
            raise TypeError("filter must be a glob, a list of globs or a callable, got NoneType")
        try:
            self._routes.add(filter, algorithm)
        except ValueError as err:  # cstorch raises TypeError for a filter of the wrong kind
            raise TypeError(str(err)) from None
        self.sparse_params.update(algorithm.sparse_params)

    def extend(self, group: Group) -> None:
        if not isinstance(group, Group):
            raise TypeError(f"group must be a Group, got {type(group).__name__}")
        for own, algorithm in group._routes.routes:
            self.add(own, algorithm)

    def sparsify_parameter(self, module: torch.nn.Module, name: str, param: torch.Tensor | None) -> None:
        if param is None or self.get_sparse_params(param) is not None or getattr(param, "requires_dense", False):
            return
        algorithm = self._routes.route(name, param)
        if algorithm is not None:
            algorithm.sparsify_parameter(module, name, param)
            self.sparse_params.update(algorithm.sparse_params)

    def sparsify_module(self, module: torch.nn.Module) -> None:
        if not len(self):
            raise RuntimeError("No groups were added to the Group sparsity algorithm")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # one clearer warning below
            super().sparsify_module(module)
        if self.num_sparse_params == 0:
            warnings.warn("No parameters were sparsified: no param_filter matched a parameter of the module")

    def _forward_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        for algorithm in self.algorithms:
            algorithm._forward_pre_hook(module, args)

    def sparsify_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        super().sparsify_optimizer(optimizer)
        for algorithm in self.algorithms:
            # the optimizer is sparse already, so no second set of step hooks; RigL still hooks
            # zero_grad to clear its dense gradients
            algorithm.sparsify_optimizer(optimizer)

    def update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        for algorithm in self.algorithms:
            algorithm.update(optimizer)

    def register_target_sparsity_hook(self, hook: Callable) -> list:
        return [algorithm.register_target_sparsity_hook(hook) for algorithm in self.algorithms]

    def register_computed_sparsity_hook(self, hook: Callable) -> list:
        return [algorithm.register_computed_sparsity_hook(hook) for algorithm in self.algorithms]

    def visit_state(self, fn: Callable) -> None:
        for algorithm in self.algorithms:
            algorithm.visit_state(fn)

    def state_dict(self) -> list[Any]:
        return [algorithm.state_dict() for algorithm in self.algorithms]

    def load_state_dict(self, state_dict: Any) -> None:
        states = [state_dict] if isinstance(state_dict, dict) else list(state_dict)
        if len(states) != len(self):
            raise ValueError(f"Expected a list of {len(self)} state_dicts for the Group but got {len(states)}.")
        for state, algorithm in zip(states, self.algorithms):
            algorithm.load_state_dict(state)
