"""``cstorch.optim.Optimizer`` and the optimizers whose arithmetic cstorch defines itself.

``SGD``, ``Adam``, ``AdamW``, ``Lion``, ``Adagrad``, ``Adamax`` and ``NAdam`` compute what
cstorch's do, with its defaults (Adam's ``eps`` 1e-6 added after the square root and bias
correction folded into the step size; state created at construction), so a script's losses
match the reference. The names cstorch gives PyTorch's optimizers are in ``torch_named``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "Lion", "Adagrad", "Adamax", "NAdam"]


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

    def _count_step(self, p: torch.Tensor) -> torch.Tensor:
        """Adds one to ``p``'s step count (a float32 tensor in its state, as cstorch keeps it
        for optimizers whose arithmetic needs the step) and returns it."""
        self.state[p]["step"] += 1.0
        return self.state[p]["step"]

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


def _check_non_negative(name: str, **values: float) -> None:
    for field, value in values.items():
        if value < 0.0:
            raise ValueError(f"{name}: {field} must be >= 0, got {value}")


def _check_betas(name: str, betas: tuple[float, float]) -> None:
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name}: betas must be in [0, 1), got {betas}")


class Adagrad(Optimizer):
    """cstorch's defaults (``eps`` 1e-6) and order: the decayed gradient over ``sqrt(sum) + eps``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, lr_decay: float = 0, weight_decay: float = 0,
                 initial_accumulator_value: float = 0, eps: float = 1e-6, maximize: bool = False) -> None:
        _check_non_negative("Adagrad", lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                            initial_accumulator_value=initial_accumulator_value, eps=eps)
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, maximize=maximize))
        self.preinitialize()

    def preinitialize(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["sum"] = torch.full_like(p, group["initial_accumulator_value"])
                self.state[p]["step"] = torch.tensor(0.0, device=p.device)

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                step = self._count_step(p)
                grad = (-p.grad if group["maximize"] else p.grad) + p * group["weight_decay"]
                squares = self.state[p]["sum"]
                squares.addcmul_(grad, grad)
                decayed = grad / (1.0 + (step - 1.0) * group["lr_decay"])
                p.addcdiv_(decayed * -group["lr"], squares.sqrt().add_(group["eps"]))
        return loss


class Adamax(Optimizer):
    """cstorch's defaults (``lr`` 1e-3, ``eps`` 1e-6); the bias correction divides the update,
    from a ``beta1_power`` kept in the state."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, maximize: bool = False) -> None:
        _check_non_negative("Adamax", lr=lr, eps=eps)
        _check_betas("Adamax", betas)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize))
        self.preinitialize()

    def preinitialize(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["exp_avg"], state["exp_inf"] = torch.zeros_like(p), torch.zeros_like(p)
                state["beta1_power"] = torch.tensor(group["betas"][0]).to(p.device)

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = (-p.grad if group["maximize"] else p.grad) + p * group["weight_decay"]
                state = self.state[p]
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
                torch.maximum(state["exp_inf"].mul(beta2), grad.abs().add_(group["eps"]), out=state["exp_inf"])
                update = state["exp_avg"] / state["exp_inf"] / (1.0 - state["beta1_power"])
                state["beta1_power"] *= beta1
                p.sub_(update * group["lr"])
        return loss


class NAdam(Optimizer):
    """cstorch's arithmetic: PyTorch's NAdam except that the momentum term's denominator uses
    ``mu_product * mu * mu_next`` (``mu`` of this step counted twice; PyTorch's has
    ``mu_product * mu_next``); powers taken in float32 of the float32 step count."""

    def __init__(self, params: Iterable[Any], lr: float = 2e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, momentum_decay: float = 4e-3) -> None:
        _check_non_negative("NAdam", lr=lr, eps=eps, weight_decay=weight_decay, momentum_decay=momentum_decay)
        _check_betas("NAdam", betas)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      momentum_decay=momentum_decay))
        self.preinitialize()

    def preinitialize(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["mu_product"] = torch.tensor(1.0).to(p.device)
                state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] = torch.tensor(0.0, device=p.device)

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                step = self._count_step(p)
                decay = torch.tensor(0.96, device=p.device)
                mu = beta1 * (1.0 - 0.5 * torch.pow(decay, step * group["momentum_decay"]))
                mu_next = beta1 * (1.0 - 0.5 * torch.pow(decay, (step + 1) * group["momentum_decay"]))
                state["mu_product"] *= mu
                mu_product = state["mu_product"]
                grad = p.grad + p * group["weight_decay"]
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                second_correction = 1 - torch.pow(torch.tensor(beta2, device=p.device), step)
                denominator = state["exp_avg_sq"].div(second_correction).sqrt().add_(group["eps"])
                momentum_term = mu_next * state["exp_avg"] / (1.0 - mu_product * mu * mu_next)
                gradient_term = grad * (1.0 - mu) / (1.0 - mu_product)
                p.addcdiv_((momentum_term + gradient_term) * -group["lr"], denominator)
        return loss

