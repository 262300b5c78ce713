"""``cstorch.amp``: mixed precision and loss scaling with cstorch's names and arguments.

``GradScaler(loss_scale="dynamic", init_scale=..., steps_per_increase=..., min_loss_scale=...,
max_loss_scale=..., overflow_tolerance=..., max_gradient_norm=...)`` scales the loss, unscales
the gradients, and on a non-finite gradient norm skips the step as cstorch does: it runs the
optimizer step, its hooks included (so a sparsity update draws its random numbers and the
global RNG stream stays where the reference leaves it), with ``isfinite(optimizer)`` False,
and then rolls back the weights, the optimizer state and every tensor marked with
``update_if_finite`` (the sparsity ``step``), so masks, weights and state hold. The LR
schedulers hold too (the reference's writes its next learning rate into the groups: docs/cstorch.md).
Its scale arithmetic is cstorch's (halved when the overflow ratio exceeds
``overflow_tolerance``, doubled after ``steps_per_increase`` clean steps, clamped). A constant
``loss_scale`` (default 1.0) scales by that number and never skips.

``set_half_dtype`` / ``use_bfloat16`` choose the 16-bit type that ``autocast()`` uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["init", "GradScaler", "optimizer_step", "set_half_dtype", "get_half_dtype", "use_bfloat16", "autocast",
           "isfinite", "update_if_finite", "mixed_precision", "enable_mixed_precision"]

_state: dict[str, Any] = {"half_dtype": torch.float16, "enabled": False}
_HALF_TYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "cbfloat16": torch.bfloat16}


def init(enabled: bool = True, enable_caching: bool = True, verbose: bool = False,
         allow_banned: bool = False) -> None:
    """cstorch's automatic-cast setup (its CSX backend calls it); nothing to set up here."""


def set_half_dtype(value: str | torch.dtype) -> torch.dtype:
    """``"float16"``, ``"bfloat16"`` or ``"cbfloat16"`` (bfloat16 off a CS system), or a dtype."""
    if isinstance(value, torch.dtype):
        if value not in (torch.float16, torch.bfloat16):
            raise ValueError(f"half dtype must be float16 or bfloat16, got {value}")
        dtype = value
    elif value in _HALF_TYPES:
        dtype = _HALF_TYPES[value]
    else:
        raise ValueError(f"half dtype must be one of {sorted(_HALF_TYPES)}, got {value!r}")
    _state["half_dtype"], _state["enabled"] = dtype, True
    return dtype


def get_half_dtype() -> torch.dtype:
    return _state["half_dtype"]


def use_bfloat16(use: bool) -> None:
    """cstorch 1.x/2.0: ``use_bfloat16(True)`` picks bfloat16 as the half type."""
    set_half_dtype("bfloat16" if use else "float16")


def mixed_precision() -> bool:
    return bool(_state["enabled"])


def enable_mixed_precision(enable: bool = True) -> bool:
    _state["enabled"] = bool(enable)
    return _state["enabled"]


def autocast(enabled: bool = True) -> torch.autocast:
    """``torch.autocast`` on the CPU with the chosen half dtype."""
    return torch.autocast("cpu", dtype=get_half_dtype(), enabled=enabled)


def isfinite(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's last scaled step had finite gradients."""
    return not getattr(optimizer, "_cstorch_step_skipped", False)


def update_if_finite(optimizer: torch.optim.Optimizer, tensor: torch.Tensor) -> None:
    """Marks ``tensor`` to be rolled back if the step running now is skipped (a no-op outside
    a skipped step's run)."""
    rollback = getattr(optimizer, "_cstorch_rollback", None)
    if rollback is not None and isinstance(tensor, torch.Tensor) and not any(t is tensor for t, _ in rollback):
        rollback.append((tensor, tensor.detach().clone()))


@torch.no_grad()
def _run_and_roll_back(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    """Runs ``optimizer.step`` and restores what it changed: the weights, the optimizer state
    (state created by the step is dropped) and the tensors marked with ``update_if_finite``."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    marked = [(p, p.detach().clone()) for p in params]
    states = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()}
              for p in params if p in optimizer.state}
    optimizer._cstorch_rollback = marked
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer._cstorch_rollback
        for tensor, saved in marked:
            tensor.copy_(saved)
        for p in params:
            if p in states:
                optimizer.state[p] = states[p]
            else:
                optimizer.state.pop(p, None)


class GradScaler:
    def __init__(self, loss_scale: str | float | None = None, init_scale: float | None = None,
                 steps_per_increase: int | None = None, min_loss_scale: float | None = None,
                 max_loss_scale: float | None = None, overflow_tolerance: float = 0.0,
                 max_gradient_norm: float | None = None) -> None:
        default_max = 2.0 ** 15
        self.dynamic = loss_scale == "dynamic"
        if not self.dynamic and loss_scale is not None and not isinstance(loss_scale, (int, float)):
            raise ValueError(f"loss_scale must be 'dynamic' or a number, got {loss_scale!r}")
        self._min_loss_scale = min_loss_scale or 2.0 ** -14
        self._max_loss_scale = max_loss_scale or default_max
        self._steps_per_increase = steps_per_increase or 2000
        if self.dynamic:
            if self._min_loss_scale < 2.0 ** -14:
                raise ValueError("min_loss_scale too small (minimum 2**-14)")
            if overflow_tolerance < 0:
                raise ValueError("overflow_tolerance must be >= 0")
            self._loss_scale = min(self._max_loss_scale, init_scale or default_max)
        else:
            self._loss_scale = float(loss_scale or 1.0)
        self._overflow_tolerance = overflow_tolerance
        self._max_gradient_norm = max_gradient_norm
        self._steps_since_rescale = 0
        self._overflows_since_rescale = 0
        self._num_skipped_steps = 0
        self._unscaled: set[int] = set()
        self._found_inf = False
        self.global_norm: torch.Tensor | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.float() * self._loss_scale if self._loss_scale != 1.0 else loss.float()

    def get_scale(self) -> torch.Tensor:
        return torch.tensor(self._loss_scale, dtype=torch.float32)

    def get_num_skipped_steps(self) -> torch.Tensor:
        return torch.tensor(self._num_skipped_steps, dtype=torch.int64)

    @staticmethod
    def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._unscaled:
            return
        self._unscaled.add(id(optimizer))
        grads = self._grads(optimizer)
        if self._loss_scale != 1.0:
            for grad in grads:
                grad.mul_(1.0 / self._loss_scale)
        if grads:
            self.global_norm = torch.sqrt(sum(torch.sum(g.float() * g.float()) for g in grads))
            self._found_inf = self._found_inf or not bool(torch.isfinite(self.global_norm))

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self.unscale_(optimizer)
        skip = self.dynamic and self._found_inf
        optimizer._cstorch_step_skipped = skip
        if skip:
            self._num_skipped_steps += 1
            return _run_and_roll_back(optimizer, *args, **kwargs)
        if self._max_gradient_norm and self.global_norm is not None:
            factor = min(self._max_gradient_norm / (float(self.global_norm) + 1e-6), 1.0)
            for grad in self._grads(optimizer):
                grad.mul_(factor)
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        if new_scale:
            raise ValueError("cstorch.amp.GradScaler does not support providing a `new_scale`")
        if self.dynamic:
            self._steps_since_rescale += 1
            self._overflows_since_rescale += int(self._found_inf)
            if self._overflows_since_rescale / self._steps_since_rescale > self._overflow_tolerance:
                self._loss_scale /= 2
                self._steps_since_rescale = self._overflows_since_rescale = 0
            elif self._steps_since_rescale > self._steps_per_increase:
                self._loss_scale *= 2
                self._steps_since_rescale = self._overflows_since_rescale = 0
            self._loss_scale = max(min(self._loss_scale, self._max_loss_scale), self._min_loss_scale)
        self._unscaled.clear()
        self._found_inf = False

    def state_dict(self) -> dict[str, Any]:
        state = {"loss_scale": self.get_scale()}
        if self.dynamic:
            state.update(steps_since_rescale=torch.tensor(self._steps_since_rescale),
                         overflows_since_rescale=torch.tensor(self._overflows_since_rescale),
                         num_skipped_steps=torch.tensor(self._num_skipped_steps))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loss_scale = float(state_dict.get("loss_scale", self._loss_scale))
        self._steps_since_rescale = int(state_dict.get("steps_since_rescale", self._steps_since_rescale))
        self._overflows_since_rescale = int(state_dict.get("overflows_since_rescale", self._overflows_since_rescale))
        self._num_skipped_steps = int(state_dict.get("num_skipped_steps", self._num_skipped_steps))


def optimizer_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                   grad_scaler: GradScaler, max_gradient_norm: float | None = None,
                   max_gradient_value: float | None = None) -> None:
    """cstorch's whole step: scaled backward, unscale, clip (norm or value), step, update,
    zero_grad."""
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"optimizer_step: loss must be a tensor, got {type(loss).__name__}")
    if not isinstance(grad_scaler, GradScaler):
        raise TypeError(f"optimizer_step: grad_scaler must be a cstorch.amp.GradScaler, got {type(grad_scaler).__name__}")
    for field, value in (("max_gradient_norm", max_gradient_norm), ("max_gradient_value", max_gradient_value)):
        if value is not None and value < 0.0:
            raise ValueError(f"optimizer_step: {field} must be >= 0, got {value}")
    if max_gradient_norm is not None and max_gradient_value is not None:
        raise ValueError("optimizer_step: give max_gradient_norm or max_gradient_value, not both")
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    grad_scaler.scale(loss).backward()
    for opt in optimizers:
        grad_scaler.unscale_(opt)
    params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    if max_gradient_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, max_gradient_norm)
    elif max_gradient_value is not None:
        torch.nn.utils.clip_grad_value_(params, max_gradient_value)
    for opt in optimizers:
        grad_scaler.step(opt)
    grad_scaler.update()
    for opt in optimizers:
        opt.zero_grad()
