"""``cstorch.optim.Optimizer`` and the optimizers whose arithmetic cstorch defines itself.

``SGD``, ``Adam``, ``AdamW`` and ``Lion`` compute what cstorch's do (Adam's ``eps`` 1e-6 added
after the square root and bias correction folded into the step size, state created at
construction), so a script's losses match the reference. The other names are PyTorch's
optimizers of that name with cstorch's ``apply`` and zero-grad hooks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "Lion", "torch_backed"]


class Optimizer(torch.optim.Optimizer):
    """What cstorch adds to a torch optimizer: ``apply(alg)``, zero-grad pre/post hooks,
    ``preinitialize()`` (state created up front) and ``visit_state(fn)``."""

    def preinitialize(self) -> None:
        """Creates the optimizer state before the first step (cstorch's optimizers do)."""

    def _zero_grad_hooks(self, kind: str) -> OrderedDict[int, Callable]:
        name = f"_cstorch_zero_grad_{kind}_hooks"
        if name not in self.__dict__:
            self.__dict__[name] = OrderedDict()
        return self.__dict__[name]

    def register_zero_grad_pre_hook(self, hook: Callable) -> RemovableHandle:
        hooks = self._zero_grad_hooks("pre")
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def register_zero_grad_post_hook(self, hook: Callable) -> RemovableHandle:
        hooks = self._zero_grad_hooks("post")
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        for hook in list(self._zero_grad_hooks("pre").values()):
            replaced = hook(self, args, kwargs)
            if replaced is not None:
                args, kwargs = replaced
        super().zero_grad(*args, **kwargs)
        for hook in list(self._zero_grad_hooks("post").values()):
            hook(self, args, kwargs)

    def apply(self, f: Any) -> Any:
        """``optimizer.apply(sparsity)``: same as ``sparsity.apply(optimizer)``."""
        if not callable(f) or hasattr(f, "sparsify_optimizer"):
            apply = getattr(f, "apply", None)
            if callable(apply):
                return apply(self)
            raise TypeError(f"apply() expects a callable or a sparsity algorithm, got {type(f).__name__}")
        return f(self)

    def visit_state(self, fn: Callable[[torch.Tensor], Any]) -> None:
        for state in self.state.values():
            for key, value in list(state.items()):
                moved = fn(value)
                if moved is not None:
                    state[key] = moved


class SGD(Optimizer):
    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, nesterov: bool = False, maximize: bool = False) -> None:
        for field, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if value < 0.0:
                raise ValueError(f"SGD: {field} must be >= 0, got {value}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: nesterov needs momentum > 0 and dampening 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, maximize=maximize))
        self.preinitialize()

    def preinitialize(self) -> None:
        for group in self.param_groups:
            if group["momentum"] != 0:
                for p in group["params"]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if group["maximize"] else p.grad
                grad = grad + p * group["weight_decay"]
                if group["momentum"] != 0:
                    buffer = self.state[p]["momentum_buffer"]
                    buffer.mul_(group["momentum"]).add_(grad, alpha=1.0 - group["dampening"])
                    grad = grad.add(buffer, alpha=group["momentum"]) if group["nesterov"] else buffer
                p.add_(-group["lr"] * grad)
        return loss


class _AdamBase(Optimizer):
    """cstorch's Adam arithmetic: moments, ``update = m / (sqrt(v) + eps)`` times
    ``sqrt(1 - beta2^t) / (1 - beta1^t)``, plus decoupled ``weight_decay * p``, times lr;
    ``l2_regularization_rate`` adds ``rate * p`` to the gradient (Adam's weight_decay)."""

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, l2_regularization_rate: float, correct_bias: bool, amsgrad: bool) -> None:
        if lr < 0.0 or eps < 0.0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{type(self).__name__}: lr and eps must be >= 0 and betas in [0, 1), "
                             f"got lr={lr}, eps={eps}, betas={betas}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      l2_regularization_rate=l2_regularization_rate, correct_bias=correct_bias,
                                      amsgrad=amsgrad))
        self.preinitialize()

    def preinitialize(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p)
                if group["correct_bias"]:
                    state["beta1_power"] = torch.tensor(group["betas"][0]).to(p.device)
                    state["beta2_power"] = torch.tensor(group["betas"][1]).to(p.device)

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if group["l2_regularization_rate"] > 0.0:
                    grad = grad.add(p, alpha=group["l2_regularization_rate"])
                state = self.state[p]
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                second = state["exp_avg_sq"]
                if group["amsgrad"]:
                    torch.maximum(state["max_exp_avg_sq"], second, out=state["max_exp_avg_sq"])
                    second = state["max_exp_avg_sq"]
                update = state["exp_avg"] / second.sqrt().add_(group["eps"])
                if group["correct_bias"]:
                    one = torch.tensor(1.0, dtype=torch.float32, device=p.device)
                    update *= torch.sqrt(one - state["beta2_power"]) / (one - state["beta1_power"])
                    state["beta1_power"] *= beta1
                    state["beta2_power"] *= beta2
                update.add_(p * group["weight_decay"])
                update *= group["lr"]
                p.sub_(update)
        return loss


class AdamW(_AdamBase):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, correct_bias: bool = True, amsgrad: bool = False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, 0.0, correct_bias, amsgrad)


class Adam(_AdamBase):
    """``weight_decay`` is an L2 term added to the gradient (torch's Adam), not decoupled."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, amsgrad: bool = False) -> None:
        super().__init__(params, lr, betas, eps, 0.0, weight_decay, True, amsgrad)


class Lion(Optimizer):
    """Sign of the interpolated momentum; decoupled weight decay."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if lr < 0.0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: lr must be >= 0 and betas in [0, 1), got lr={lr}, betas={betas}")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
        self.preinitialize()

    def preinitialize(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["exp_avg"] = torch.zeros_like(p)

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                momentum = self.state[p]["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(momentum * beta1 + p.grad * (1 - beta1)), alpha=-group["lr"])
                momentum.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


def torch_backed(base: type[torch.optim.Optimizer]) -> type[Optimizer]:
    """PyTorch's optimizer ``base`` with cstorch's additions."""
    cls = type(base.__name__, (Optimizer, base), {"__doc__": f"torch.optim.{base.__name__} with cstorch's apply "
                                                             "and zero-grad hooks."})
    cls.__module__ = "sparsity.cstorch.optim"
    return cls
