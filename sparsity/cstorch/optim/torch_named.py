"""The optimizers cstorch 2.10 defines under PyTorch's names, with cstorch's arguments and
defaults: ``Adafactor`` is cstorch's (the factored Adafactor of Shazeer & Stern 2018, not
PyTorch's of the same name); ``Adadelta``, ``ASGD``, ``RAdam``, ``RMSprop``, ``Rprop`` and
``Muon`` compute with PyTorch's optimizer of that name, whose arithmetic gives cstorch's losses
(tools/cstorch_oracle/scripts/optimizers.py) except where docs/cstorch.md says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .optimizer import Optimizer

__all__ = ["Adadelta", "Adafactor", "ASGD", "Muon", "RAdam", "RMSprop", "Rprop"]

Params = Iterable[Any]


class Adadelta(Optimizer, torch.optim.Adadelta):
    def __init__(self, params: Params, lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0,
                 maximize: bool = False) -> None:
        super().__init__(params, lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize)


class ASGD(Optimizer, torch.optim.ASGD):
    def __init__(self, params: Params, lr: float = 0.01, lambd: float = 1e-4, alpha: float = 0.75, t0: float = 1e6,
                 weight_decay: float = 0, maximize: bool = False) -> None:
        super().__init__(params, lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay, maximize=maximize)


class RAdam(Optimizer, torch.optim.RAdam):
    """cstorch's defaults: ``eps`` 1e-6 (PyTorch's 1e-8)."""

    def __init__(self, params: Params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class RMSprop(Optimizer, torch.optim.RMSprop):
    def __init__(self, params: Params, lr: float = 0.01, alpha: float = 0.99, eps: float = 1e-8,
                 weight_decay: float = 0, momentum: float = 0, centered: bool = False) -> None:
        super().__init__(params, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                         centered=centered)


class Rprop(Optimizer, torch.optim.Rprop):
    """cstorch's defaults: ``lr`` 0.001 (PyTorch's 0.01)."""

    def __init__(self, params: Params, lr: float = 1e-3, etas: tuple[float, float] = (0.5, 1.2),
                 step_sizes: tuple[float, float] = (1e-6, 50.0)) -> None:
        super().__init__(params, lr=lr, etas=etas, step_sizes=step_sizes)


class Muon(Optimizer, torch.optim.Muon):
    """cstorch's arguments and defaults (``lr`` 0.02, ``weight_decay`` 0.01; PyTorch's 0.001 and
    0.1) on PyTorch's Muon: matrices only, orthogonalised momentum."""

    def __init__(self, params: Params, lr: float = 0.02, weight_decay: float = 0.01, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5) -> None:
        super().__init__(params, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                         ns_steps=ns_steps)


class Adafactor(Optimizer):
    """cstorch's Adafactor: the second moment of a matrix kept as its row and column means
    (one vector each), of a vector as is, decayed by ``1 - t ** decay_rate``; the update
    ``grad / sqrt(second moment)`` scaled down to an RMS of at most ``clip_threshold``, times
    the learning rate (times ``max(RMS(p), eps[1])`` with ``scale_parameter``), and decoupled
    weight decay ``p * weight_decay * lr``. As cstorch, only ``clip_threshold=1``, no first
    moment (``beta1=None``) and no relative step are supported; the others are refused by name.
    """

    def __init__(self, params: Params, lr: float, eps: tuple[float, float] = (1e-30, 1e-3),
                 clip_threshold: float = 1.0, decay_rate: float = -0.8, beta1: float | None = None,
                 weight_decay: float = 0.0, scale_parameter: bool = True, relative_step: bool = False,
                 warmup_init: bool = False) -> None:
        if lr is not None and relative_step:
            raise ValueError("Adafactor: give either lr or relative_step=True, not both")
        for field, value, supported in (("clip_threshold", clip_threshold, 1.0), ("beta1", beta1, None),
                                        ("relative_step", relative_step, False), ("warmup_init", warmup_init, False)):
            if value != supported:
                raise ValueError(f"Adafactor: {field}={value!r} is not supported, as in cstorch; only "
                                 f"{field}={supported!r}")
        if not (isinstance(eps, (tuple, list)) and len(eps) == 2 and all(isinstance(x, float) for x in eps)):
            raise ValueError(f"Adafactor: eps must be a tuple of two floats, got {eps!r}")
        super().__init__(params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate,
                                      beta1=beta1, weight_decay=weight_decay, scale_parameter=scale_parameter,
                                      relative_step=relative_step, warmup_init=warmup_init))
        self.preinitialize()

    def preinitialize(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if p.dim() >= 2:
                    state["exp_avg_sq_row"] = torch.zeros(p.shape[:-1], device=p.device)
                    state["exp_avg_sq_col"] = torch.zeros(p.shape[:-2] + p.shape[-1:], device=p.device)
                else:
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] = torch.tensor(0.0, device=p.device)

    @staticmethod
    def _rms(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.square().mean().sqrt()

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if group["lr"] is None:
                raise ValueError("Adafactor: this param group has no learning rate; give lr or a scheduler")
            for p in group["params"]:
                if p.grad is None:
                    continue
                state, grad = self.state[p], p.grad
                step = self._count_step(p)
                lr = group["lr"]
                if group["scale_parameter"]:
                    lr = torch.maximum(self._rms(p), torch.tensor(group["eps"][1])) * lr
                kept = 1.0 - torch.pow(step, torch.tensor(group["decay_rate"], device=p.device))
                squared = grad.square() + group["eps"][0]
                if "exp_avg_sq_row" in state:
                    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                    row.mul_(kept).add_(squared.mean(dim=-1).mul(1.0 - kept))
                    col.mul_(kept).add_(squared.mean(dim=-2).mul(1.0 - kept))
                    row_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1)
                    update = torch.mul(row_factor, col.rsqrt().unsqueeze(-2)).mul_(grad)
                else:
                    state["exp_avg_sq"].mul_(kept).add_(squared.mul(1.0 - kept))
                    update = state["exp_avg_sq"].rsqrt().mul_(grad)
                update.div_(torch.maximum(self._rms(update) / group["clip_threshold"], torch.tensor(1.0)))
                update.mul_(lr)
                p.sub_(p.mul(group["weight_decay"] * lr))
                p.sub_(update)
        return loss
