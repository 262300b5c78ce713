"""``SparsityWrapperOptimizer``: an optimizer whose checkpoints carry the sparsity state.

``configure_sparsity_wrapper(model, optimizer, config)`` returns one, as cstorch's does: a
drop-in ``torch.optim.Optimizer`` (LR schedulers, ``clip_grad_norm_`` over its param groups,
``zero_grad``, ``step``) whose ``state_dict()`` holds the wrapped optimizer's state plus the
algorithm's under ``"sparsity"``, so a resume through it restores the sparsity step, schedules
and statistics along with the moments. The masks themselves travel in ``model.state_dict()``.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import SparsityAlgorithm

__all__ = ["SparsityWrapperOptimizer"]

SPARSITY_KEY = "sparsity"


class SparsityWrapperOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer``, to which ``algorithm`` is applied; everything but the state dict is
    the wrapped optimizer's own (its step hooks do the sparsity work)."""

    def __init__(self, optimizer: torch.optim.Optimizer, algorithm: SparsityAlgorithm) -> None:
        # Optimizer.__init__ would build new param groups; these are the wrapped optimizer's.
        self.optimizer = optimizer
        self.algorithm = algorithm
        algorithm.apply(optimizer)

    # The wrapped optimizer's containers, shared rather than copied (LR schedulers edit them).
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def step(self, closure: Any = None) -> Any:
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def register_step_pre_hook(self, hook: Any) -> Any:
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> Any:
        return self.optimizer.register_step_post_hook(hook)

    def state_dict(self) -> dict[str, Any]:
        return {**self.optimizer.state_dict(), SPARSITY_KEY: self.algorithm.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)  # the caller's dict is left as it was
        if SPARSITY_KEY not in state:
            raise ValueError(
                "this optimizer state_dict has no 'sparsity' entry: it was not saved through a "
                "sparsity wrapper. Load it into the wrapped optimizer (wrapper.optimizer) and the "
                "sparsity state, if any, with wrapper.algorithm.load_state_dict(...)"
            )
        self.algorithm.load_state_dict(state.pop(SPARSITY_KEY))
        self.optimizer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"SparsityWrapperOptimizer({self.optimizer!r}, {self.algorithm!r})"
