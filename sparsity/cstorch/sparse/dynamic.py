"""``cstorch.sparse.dynamic``: ``DynamicSparsityAlgorithm``, masks that change on update steps.

Per optimizer step (``update(optimizer)``, from the step post-hook): ``self.step`` (an int64
0-d tensor) becomes the number of steps taken; ``self.is_update_step`` (a bool 0-d tensor, an
attribute as in cstorch) says whether masks change now; for every sparse parameter with a
gradient, ``update_mask(p, mask, sparsity)`` gets the clamped level as a 0-d tensor, and its
result replaces the mask only on update steps. The target hook fires once per distinct
schedule (``name`` = common prefix of its parameters + ``*``) and the computed hook once per
parameter, every step, with tensors. ``update=None`` means every step. A step that the
GradScaler skips for non-finite gradients runs as in cstorch, random draws included, with
``is_update_step`` False, and the GradScaler rolls ``step`` back after it.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from typing import Any

import torch

from .. import amp
from .base import SparsityAlgorithm
from .reference_rules import make_update_schedule, starts_sparse

__all__ = ["DynamicSparsityAlgorithm"]


class DynamicSparsityAlgorithm(SparsityAlgorithm):
    def __init__(self, sparsity: Any = None, update: Any = None, **kwargs: Any) -> None:
        super().__init__(sparsity=sparsity, **kwargs)
        self.update_schedule = make_update_schedule(update)
        self.starts_sparse = starts_sparse(self.update_schedule)
        if not bool(self.starts_sparse):
            self.init_method = lambda p, sparsity, **_: torch.ones_like(p, dtype=torch.bool)
        self.step = torch.tensor(0, dtype=torch.int64)
        self._is_update_step: torch.Tensor | None = None

    @property
    def is_update_step(self) -> torch.Tensor:
        """Whether the current ``step`` changes masks (a bool 0-d tensor)."""
        if self._is_update_step is None:
            self._is_update_step = torch.as_tensor(self.update_schedule(self.step), dtype=torch.bool)
        return self._is_update_step

    @is_update_step.setter
    def is_update_step(self, value: Any) -> None:
        self._is_update_step = torch.as_tensor(value, dtype=torch.bool)

    def sparsify_parameter(self, module: torch.nn.Module, name: str, param: torch.Tensor | None) -> None:
        super().sparsify_parameter(module, name, param)
        if param is not None and self.get_sparse_params(param) is not None:
            self.sparsity[param].update(self.starts_sparse)

    def _schedules_used(self, optimizer: Any) -> list[tuple[Any, list[str]]]:
        found: list[tuple[Any, list[str]]] = []
        for sparse_param in self.get_sparse_params(optimizer):
            schedule = self.sparsity[sparse_param.param]
            for known, names in found:
                if known is schedule:
                    names.append(sparse_param.name)
                    break
            else:
                found.append((schedule, [sparse_param.name]))
        return found

    @torch.no_grad()
    def update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        if optimizer is not None:
            amp.update_if_finite(optimizer, self.step)  # a skipped step's count is rolled back
        self.step += 1
        self._is_update_step = None
        if optimizer is not None and not amp.isfinite(optimizer):
            self.is_update_step = False  # masks hold on a skipped step
        pending = self._schedules_used(optimizer)
        for sparse_param in list(self.get_sparse_params(optimizer)):
            param, mask = sparse_param.param, sparse_param.mask
            if param.grad is None:
                continue
            schedule = self.sparsity[param]
            level = torch.clamp(schedule(self.step).to(param.device), 0.0, 1.0)
            schedule.update(self.is_update_step)
            for index, (known, names) in enumerate(pending):
                if known is schedule:
                    del pending[index]
                    for hook in self._target_sparsity_hooks.values():
                        hook(self, os.path.commonprefix(names) + "*", level)
                    break
            new_mask = torch.where(self.is_update_step, self.update_mask(param, mask, level), mask)
            sparse_param.mask = new_mask
            if self._computed_sparsity_hooks:
                actual = 1 - new_mask.sum() / new_mask.numel()
                for hook in self._computed_sparsity_hooks.values():
                    hook(self, sparse_param.name, actual)
        self._end_step()

    def _end_step(self) -> None:
        for schedule in self.sparsity.values():
            schedule.cache_clear()
        self._is_update_step = None

    @abstractmethod
    def update_mask(self, p: torch.Tensor, mask: torch.Tensor, sparsity: torch.Tensor) -> torch.Tensor:
        """The new bool mask of ``p`` at ``sparsity`` (a 0-d tensor)."""

    def visit_state(self, fn: Any) -> None:
        moved = fn(self.step)
        if moved is not None:
            self.step = moved
        for schedule in self._distinct_schedules():
            schedule.visit_state(fn)

    def _distinct_schedules(self) -> dict[int, tuple[Any, str]]:
        """id → (schedule, name of the last parameter using it), as cstorch keys its state."""
        found: dict[int, tuple[Any, str]] = {}
        for sparse_param in self.sparse_params.values():
            schedule = self.sparsity[sparse_param.param]
            found[id(schedule)] = (schedule, sparse_param.name)
        return found

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "sparsity": {name: state for schedule, name in self._distinct_schedules().values()
                         if (state := schedule.state_dict())},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores ``step`` and the schedules' state (cstorch drops the latter and empties the
        caller's dict; here the dict is left as it was)."""
        self.step = torch.as_tensor(state_dict["step"], dtype=torch.int64).clone()
        saved = state_dict.get("sparsity", {})
        for schedule, name in self._distinct_schedules().values():
            if saved.get(name):
                schedule.load_state_dict(saved[name])

    def constant_level(self, param: torch.Tensor) -> float | None:
        return super().constant_level(param) if bool(self.starts_sparse) else None
