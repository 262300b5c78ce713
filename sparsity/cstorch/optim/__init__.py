"""``cstorch.optim``: cstorch's optimizers, its schedulers of learning rate and weight decay
(``lr_scheduler``, ``weight_decay_scheduler``, both over ``scheduler``), ``configure_optimizer``
and ``configure_lr_scheduler`` (ModelZoo's ``optimizer`` / ``learning_rate`` config sections)."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

from .._subclasses import concrete_subclasses
from . import lr_scheduler, scheduler, weight_decay_scheduler
from .lr_scheduler import LRScheduler
from .optimizer import SGD, Adagrad, Adam, Adamax, AdamW, Lion, NAdam, Optimizer
from .torch_named import ASGD, Adadelta, Adafactor, Muon, RAdam, RMSprop, Rprop

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "Lion", "Adagrad", "Adamax", "NAdam", "Adadelta", "Adafactor",
           "ASGD", "Muon", "RAdam", "RMSprop", "Rprop", "lr_scheduler", "scheduler", "weight_decay_scheduler",
           "configure_optimizer", "configure_lr_scheduler"]

# Renamed keys of older configs, refused with the new name (as cstorch does).
_OPTIMIZER_ALIASES = {"weight_decay": ("weight_decay_rate",), "betas": ("beta1", "beta2"), "eps": ("eps1", "eps2")}
_SCHEDULER_ALIASES = {"total_iters": ("steps", "decay_steps"), "initial_learning_rate": ("learning_rate", "base_lr"),
                      "learning_rates": ("values",), "milestones": ("boundaries",)}


def _constructor_kwargs(cls: type, options: dict[str, Any], aliases: dict[str, tuple[str, ...]],
                        what: str, first: str) -> dict[str, Any]:
    chosen: dict[str, Any] = {}
    parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]
    for parameter in parameters:
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            chosen.update(options)
            options.clear()
            break
        if parameter.name in options:
            chosen[parameter.name] = options.pop(parameter.name)
        else:
            renamed = [old for old in aliases.get(parameter.name, ()) if old in options]
            if renamed:
                raise ValueError(f"{what} {cls.__name__}: '{renamed[0]}' is no longer accepted; use '{parameter.name}'")
    if options:
        raise ValueError(f"{what} {cls.__name__}: unknown parameters {sorted(options)}; it takes "
                         f"{[p.name for p in parameters]} after {first}")
    return chosen


def configure_optimizer(optimizer_type: str, params: Any, **kwargs: Any) -> Optimizer:
    """The optimizer named ``optimizer_type`` (any case) over ``params``; ``learning_rate`` is
    its ``lr``, ``optim_params`` a nested dict of more options."""
    options = {**{k: v for k, v in kwargs.items() if k != "optim_params"}, **kwargs.get("optim_params", {})}
    known = concrete_subclasses(Optimizer)
    cls = known.get(str(optimizer_type).lower())
    if cls is None:
        raise ValueError(f"optimizer_type must be one of {sorted(known)}, got {optimizer_type!r}")
    learning_rate = options.pop("learning_rate", None)
    if "lr" in inspect.signature(cls.__init__).parameters and "lr" not in options and learning_rate is not None:
        options["lr"] = float(learning_rate)
    return cls(params, **_constructor_kwargs(cls, options, _OPTIMIZER_ALIASES, "optimizer", "params"))


def _one_scheduler(optimizer: torch.optim.Optimizer, config: dict[str, Any]) -> LRScheduler:
    options = dict(config)
    name = str(options.pop("scheduler", "")).lower()
    known = concrete_subclasses(LRScheduler)
    cls = known.get(name) or known.get(f"{name}lr")
    if cls is None:
        raise ValueError(f"learning_rate.scheduler must be one of {sorted(known)}, got {name!r}")
    return cls(optimizer, **_constructor_kwargs(cls, options, _SCHEDULER_ALIASES, "scheduler", "optimizer"))


def configure_lr_scheduler(optimizer: torch.optim.Optimizer, learning_rate: Any,
                           adjust_learning_rate: dict[str, float] | None = None) -> LRScheduler | None:
    """A number → ConstantLR; a dict → that scheduler; a list → SequentialLR over them, switching
    at each one's ``total_iters`` (or ChainedLR with ``main_scheduler: chained``)."""
    if not learning_rate:
        return None
    configs = copy.deepcopy(learning_rate)
    if isinstance(configs, (int, float, str)):
        configs = [{"scheduler": "constant", "learning_rate": float(configs)}]
    elif isinstance(configs, dict):
        configs = [configs]
    elif not isinstance(configs, (list, tuple)):
        raise ValueError(f"learning_rate must be a number, a dict or a list, got {type(learning_rate).__name__}")
    main = {c.pop("main_scheduler") for c in configs if "main_scheduler" in c}
    if len(main) > 1:
        raise ValueError(f"learning_rate: conflicting main_scheduler values {sorted(main)}")
    schedulers = [_one_scheduler(optimizer, c) for c in configs]
    if len(schedulers) == 1:
        scheduler = schedulers[0]
    elif main and next(iter(main)).lower() in ("chained", "chainedlr"):
        scheduler = lr_scheduler.ChainedLR(schedulers)
    else:
        milestones, total = [], 0
        for index, sched in enumerate(schedulers[:-1]):
            if sched.total_iters is None:
                raise ValueError(f"learning_rate[{index}] needs total_iters to be followed by another scheduler")
            total += int(sched.total_iters)
            milestones.append(total)
        scheduler = lr_scheduler.SequentialLR(optimizer, schedulers, milestones)
    if adjust_learning_rate:
        scheduler = lr_scheduler.ScalePerParamLR(optimizer, scheduler)
    return scheduler
