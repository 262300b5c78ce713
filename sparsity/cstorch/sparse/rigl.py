"""``cstorch.sparse.rigl``: ``RigL``, drop the smallest |w|, regrow the largest |dense grad|."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from .dynamic import DynamicSparsityAlgorithm
from .utils import (
    InputGroupScoreShaper,
    OutputGroupScoreShaper,
    make_hyperparam_schedule,
    make_mask_drop_minimum,
    make_mask_grow_maximum,
)

__all__ = ["RigL"]


class RigL(DynamicSparsityAlgorithm):
    """``balance_out_groups`` / ``balance_in_groups`` (one of them) make every group of output
    rows / input columns keep the same count; ``score_shaper`` takes any object with the
    ``ScoreShaper`` protocol (``shaper(tensor) -> (rows, unshape)``) instead."""

    def __init__(self, drop_fraction: Any = 0.3, balance_in_groups: int | None = None,
                 balance_out_groups: int | None = None, score_shaper: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if balance_in_groups and balance_out_groups:
            raise ValueError("Only one of `balance_in_groups` and `balance_out_groups` can be specified at a time.")
        if score_shaper is not None and (balance_in_groups or balance_out_groups):
            raise ValueError("give either score_shaper or balance_in_groups / balance_out_groups, not both")
        if score_shaper is not None and not callable(score_shaper):
            raise ValueError(f"score_shaper must be callable (tensor -> (rows, unshape)), got {score_shaper!r}")
        self.drop_fraction = make_hyperparam_schedule(drop_fraction)
        self.balance_in_groups = balance_in_groups
        self.balance_out_groups = balance_out_groups
        self.score_shaper = score_shaper
        self._shaper_bound = False
        self._dense_grads: dict[torch.Tensor, torch.Tensor] = {}

    def sparsify_parameter(self, module: torch.nn.Module, name: str, param: torch.Tensor | None) -> None:
        if not self._shaper_bound and param is not None:
            groups, key = ((self.balance_out_groups, "balance_out_groups") if self.balance_out_groups
                           else (self.balance_in_groups, "balance_in_groups"))
            if groups:
                if not any(dim % groups == 0 for dim in param.shape):
                    raise ValueError(f"`{key}`={groups} but parameter {name} has no dimension that is a "
                                     f"multiple of {groups}: {tuple(param.shape)}")
                shaper_class = OutputGroupScoreShaper if self.balance_out_groups else InputGroupScoreShaper
                self.score_shaper = shaper_class(groups)
            self.init_method = partial(self.init_method, score_shaper=self.score_shaper)
            self._shaper_bound = True
        super().sparsify_parameter(module, name, param)

    def _grad_hook(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        if param in self._dense_grads:
            self._dense_grads[param] += grad
        else:
            self._dense_grads[param] = grad.clone()
        return super()._grad_hook(param, grad)

    def sparsify_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        super().sparsify_optimizer(optimizer)
        _after_zero_grad(optimizer, self._clear_dense_grads)

    def _clear_dense_grads(self, set_to_none: bool = True) -> None:
        if set_to_none:
            self._dense_grads = {}
        else:
            for grad in self._dense_grads.values():
                grad.zero_()

    def _end_step(self) -> None:
        super()._end_step()
        self.drop_fraction.cache_clear()

    @torch.no_grad()
    def update_mask(self, p: torch.Tensor, mask: torch.Tensor, sparsity: torch.Tensor) -> torch.Tensor:
        if p not in self._dense_grads:
            raise RuntimeError("RigL requires dense gradients: run forward and backward through the "
                               "sparsified model before optimizer.step()")
        drop_fraction = self.drop_fraction(self.step)
        self.drop_fraction.update(self.is_update_step)
        kept_mask, kept = make_mask_drop_minimum(p.abs(), mask, drop_fraction, score_shaper=self.score_shaper)
        return make_mask_grow_maximum(self._dense_grads[p].abs(), kept_mask, sparsity, kept,
                                      score_shaper=self.score_shaper)


def _after_zero_grad(optimizer: torch.optim.Optimizer, clear: Any) -> None:
    """Calls ``clear(set_to_none)`` on every ``optimizer.zero_grad``: through the cstorch
    optimizer's zero-grad hooks, or by wrapping ``zero_grad`` on a plain torch optimizer."""
    register = getattr(optimizer, "register_zero_grad_post_hook", None)
    if register is not None:
        register(lambda _opt, args, kwargs: clear(*args, **kwargs))
        return
    zero_grad = optimizer.zero_grad

    def zero_grad_and_clear(set_to_none: bool = True) -> None:
        zero_grad(set_to_none=set_to_none)
        clear(set_to_none)

    optimizer.zero_grad = zero_grad_and_clear
