"""cstorch 2.0's entry points, as ModelZoo 2.0 scripts call them:

    sparsity_opt = configure_sparsity_optimizer("rigl", list(model.named_parameters()),
                                                param_name_patterns=".*weight", sparsity=0.9,
                                                schedule={"freq": 100})
    sparsity_opt.hook_module(model); sparsity_opt.initialize_sparsity()
    optimizer = configure_sparsity_wrapper(model, optimizer, "rigl", sparsity=0.9, schedule=100)

The 2.0 options are translated as Cerebras' 2.1 → 2.2 converter does (``schedule`` as a cadence
→ ``update``, an int cadence → ``{"freq": n}``, ``sparsity_schedule: [[step, level], ...]`` →
a cycling ``sparsity`` updated at those steps; ``param_name_patterns`` are regexes searched in
the name, a dict of them one group each) and run with 2.x semantics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...filters import RegexParamFilter
from ...wrapper import SparsityWrapperOptimizer
from .configure import default_sparse_param_filter, map_sparsity_algorithm
from .group import Group

__all__ = ["configure_sparsity_optimizer", "configure_sparsity_wrapper", "LegacySparsityOptimizer"]

_NAME_SUFFIX = "sparsityoptimizer"  # 2.0 class names: RigLSparsityOptimizer, ...


def _translate(options: dict[str, Any]) -> dict[str, Any]:
    options = dict(options)
    if "sparsity_schedule" in options:
        steps, levels = zip(*options.pop("sparsity_schedule"))
        options["sparsity"] = list(levels)
        options.setdefault("update", {"steps": list(steps)})
    if "schedule" in options:
        cadence = options.pop("schedule")
        if isinstance(cadence, int) and not isinstance(cadence, bool):
            cadence = {"freq": cadence}
        options["update"] = cadence
    options.pop("add_summaries", None)
    return options


class LegacySparsityOptimizer:
    """What 2.0's ``configure_sparsity_optimizer`` returned, over a 2.x ``Group``."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def hook_module(self, module: torch.nn.Module) -> None:
        self.group.apply(module)

    def initialize_sparsity(self) -> None:
        self.group.initialize()

    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        self.group.apply(optimizer)

    def state_dict(self) -> Any:
        return self.group.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self.group.load_state_dict(state_dict)


def configure_sparsity_optimizer(sparsity_type: str, named_parameters: Any = None,
                                 param_name_patterns: Any = None,
                                 sparse_param_filter: Callable[[str, torch.Tensor], bool] | None = None,
                                 **kwargs: Any) -> LegacySparsityOptimizer:
    """``named_parameters`` is accepted for the signature: the filters are applied to the names
    of the module given to ``hook_module``."""
    name = str(sparsity_type).lower()
    name = {"sideband": "static"}.get(name.removesuffix(_NAME_SUFFIX), name.removesuffix(_NAME_SUFFIX))
    cls = map_sparsity_algorithm(name)
    group = Group()
    if isinstance(param_name_patterns, dict):
        for pattern, overrides in param_name_patterns.items():
            if overrides is not None and not isinstance(overrides, dict):
                raise ValueError(f"param_name_patterns[{pattern!r}] must be a dict of options, got {overrides!r}")
            group.add(RegexParamFilter(pattern), cls(**_translate({**kwargs, **(overrides or {})})))
        return LegacySparsityOptimizer(group)
    if isinstance(param_name_patterns, (str, list, tuple)):
        chosen = RegexParamFilter(param_name_patterns)
    elif param_name_patterns is None:
        chosen = sparse_param_filter or default_sparse_param_filter
    else:
        raise ValueError(f"param_name_patterns must be a regex, a list or a dict, got {param_name_patterns!r}")
    group.add(chosen, cls(**_translate(kwargs)))
    return LegacySparsityOptimizer(group)


def configure_sparsity_wrapper(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                               sparsity_type: Any, param_name_patterns: Any = None,
                               sparse_param_filter: Callable[[str, torch.Tensor], bool] | None = None,
                               **kwargs: Any) -> SparsityWrapperOptimizer:
    """A drop-in optimizer whose ``state_dict()`` carries the sparsity state under
    ``"sparsity"``. ``sparsity_type`` is 2.0's algorithm name (options as keywords) or a 2.x
    config (a number, dict or list, as ``configure`` takes)."""
    if isinstance(sparsity_type, str):
        sparsity = configure_sparsity_optimizer(sparsity_type, None, param_name_patterns,
                                                sparse_param_filter, **kwargs)
        sparsity.hook_module(model)
        sparsity.initialize_sparsity()
        return SparsityWrapperOptimizer(optimizer, sparsity)
    from .configure import configure

    group = configure(sparsity_type)
    if group is None:
        raise ValueError("configure_sparsity_wrapper: the config's sparsity is None")
    group.apply(model)
    group.initialize()
    return SparsityWrapperOptimizer(optimizer, group)
