"""``cstorch.sparse.base``: ``SparsityAlgorithm`` and ``SparseParameter`` with cstorch 2.x's
lifecycle, on any ``torch.optim`` optimizer.

* ``alg.apply(model)`` (or ``model.apply(alg)``) registers a persistent bool buffer
  ``<param>_mask`` per claimed parameter and one forward pre-hook on that root module;
  ``alg.apply(optimizer)`` (or ``optimizer.apply(alg)``) registers step pre/post hooks.
* ``alg.initialize()`` computes the initial masks (``DataExecutor`` calls it at run start).
  Where cstorch trains dense if it is never called, the first forward calls it here.
* Each forward: the weight is multiplied by its mask; the first one registers a gradient hook
  returning ``where(mask, grad, 0)``.
* ``optimizer.step()``: the pre-hook masks every state tensor of the parameter's shape, the
  post-hook masks parameter and state again, then ``update(optimizer)`` runs (``autoupdate``).
* ``model.load_state_dict``: a checkpoint's ``<param>_mask`` is kept by ``initialize()``; a
  NaN-sentinel checkpoint (no mask key, NaN at pruned positions) loads too, its mask being
  where the weight is finite; a weight with neither (a dense checkpoint) loads and gets its
  mask from ``initialize()``; a loaded mask whose level differs from a constant configured
  level is re-pruned to the configured level with a warning (cstorch keeps the old level).
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...base import _outermost_apply_root
from ...keeping import fill_missing_mask
from .._device_rng import Device
from .._runtime import RUNTIME
from .init import make_init_method
from .utils import Constant, HyperParameterSchedule, make_hyperparam_schedule, make_mask_topk_sparsity

__all__ = ["SparsityAlgorithm", "SparseParameter"]


class _SchedulePerParameter:
    """``alg.sparsity[param]``: a schedule per parameter, falling back to a default."""

    def __init__(self, default: HyperParameterSchedule | None, per_param: dict[int, Any] | None = None) -> None:
        self.default = default
        self._per_param: dict[int, tuple[torch.Tensor, HyperParameterSchedule]] = dict(per_param or {})

    def __getitem__(self, param: torch.Tensor) -> HyperParameterSchedule:
        if id(param) in self._per_param:
            return self._per_param[id(param)][1]
        if self.default is None:
            raise ValueError("this sparsity algorithm was given no 'sparsity'")
        return self.default

    def __setitem__(self, param: torch.Tensor, schedule: Any) -> None:
        self._per_param[id(param)] = (param, make_hyperparam_schedule(schedule))

    def values(self) -> list[HyperParameterSchedule]:
        found = [schedule for _, schedule in self._per_param.values()]
        return found + ([self.default] if self.default is not None else [])


class SparsityAlgorithm(ABC):
    """Base of every cstorch-style algorithm; subclasses implement ``update(optimizer)``."""

    _instances_per_class: dict[type, int] = {}

    def __init__(self, sparsity: Any = None, init_method: str | Callable[..., torch.Tensor] = "random") -> None:
        count = SparsityAlgorithm._instances_per_class.get(type(self), 0)
        SparsityAlgorithm._instances_per_class[type(self)] = count + 1
        self.name = f"sparsity_{type(self).__name__.lower()}_{count}"
        self._sparsity = _SchedulePerParameter(None)
        if sparsity is not None:
            self.sparsity = sparsity
        self.init_method = make_init_method(init_method)
        self.sparse_params: OrderedDict[str, SparseParameter] = OrderedDict()
        self.sparse_optimizers: list[torch.optim.Optimizer] = []
        self.autoupdate = True
        self._target_sparsity_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._computed_sparsity_hooks: OrderedDict[int, Callable] = OrderedDict()
        RUNTIME.register_sparsity(self)

    # ------------------------------------------------------------------------ sparsity
    @property
    def sparsity(self) -> _SchedulePerParameter:
        return self._sparsity

    @sparsity.setter
    def sparsity(self, sparsity: Any) -> None:
        if isinstance(sparsity, dict) and any(isinstance(key, torch.Tensor) for key in sparsity):
            self._sparsity = _SchedulePerParameter(None)
            for param, schedule in sparsity.items():
                self._sparsity[param] = schedule
        else:
            self._sparsity = _SchedulePerParameter(make_hyperparam_schedule(sparsity), self._sparsity._per_param)

    @property
    def num_sparse_params(self) -> int:
        return len(self.sparse_params)

    # ------------------------------------------------------------------------ attaching
    def apply(self, obj: nn.Module | torch.optim.Optimizer) -> None:
        if isinstance(obj, nn.Module):
            self.sparsify_module(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            self.sparsify_optimizer(obj)
        else:
            raise TypeError(f"apply() takes a torch.nn.Module or an optimizer, got {type(obj).__name__}")

    def __call__(self, module: nn.Module) -> None:
        # model.apply(alg) calls alg on every submodule and on the root last; names are relative
        # to that root, so only the outermost call acts.
        if module is _outermost_apply_root(module):
            self.apply(module)

    def get_sparse_params(self, obj: Any) -> Any:
        """The ``SparseParameter`` of a tensor (or None), or those of a module / optimizer."""
        if isinstance(obj, torch.Tensor):
            return getattr(obj, "_sparse_param", None)
        if isinstance(obj, nn.Module):
            params: Iterator[torch.Tensor] = (p for _, p in obj.named_parameters())
        elif isinstance(obj, torch.optim.Optimizer):
            params = (p for group in obj.param_groups for p in group["params"])
        elif obj is None:
            return iter(list(self.sparse_params.values()))
        else:
            raise TypeError(f"expected a module, an optimizer or a tensor, got {type(obj).__name__}")
        return (sp for p in params if (sp := getattr(p, "_sparse_param", None)) is not None
                and self.sparse_params.get(sp.name) is sp)

    def sparsify_module(self, module: nn.Module) -> None:
        """Offers every parameter under every name it has to ``sparsify_parameter``: a tied
        weight goes to the first of its names the filter takes (cstorch's order), and
        ``sparsify_parameter`` skips it under the names after that."""
        before = self.num_sparse_params
        for module_name, submodule in module.named_modules():
            if getattr(submodule, "requires_dense", False):
                continue
            if getattr(submodule, "is_sparse", False):
                warnings.warn(f"Module {module_name or type(submodule).__name__} has already been sparsified.")
                continue
            submodule.is_sparse = True
            for attr, param in list(submodule._parameters.items()):
                self.sparsify_parameter(submodule, f"{module_name}.{attr}" if module_name else attr, param)
        if self.num_sparse_params == before:
            warnings.warn(f"No parameters were sparsified in module {type(module).__name__}")
            return
        module.register_forward_pre_hook(self._forward_pre_hook)

    def sparsify_parameter(self, module: nn.Module, name: str, param: torch.Tensor | None) -> None:
        if param is None or self.get_sparse_params(param) is not None or getattr(param, "requires_dense", False):
            return
        level = torch.clamp(self.sparsity[param](getattr(self, "step", 0)), 0.0, 1.0)
        sparse_param = SparseParameter(module, name, partial(self.init_method, sparsity=level), self)
        param._sparse_param = sparse_param
        self.sparse_params[name] = sparse_param

    def initialize(self) -> None:
        """Computes every mask not initialised yet (nor loaded from a checkpoint), drawing
        random numbers as cstorch does under its device context."""
        with Device():
            for sparse_param in self.sparse_params.values():
                sparse_param.initialize()

    def _forward_pre_hook(self, module: nn.Module, args: Any) -> None:
        for sparse_param in self.get_sparse_params(module):
            sparse_param.initialize()
            sparse_param.clear()
            self.prune_weight(sparse_param)

    @torch.no_grad()
    def prune_weight(self, sparse_param: SparseParameter) -> None:
        param = sparse_param.param
        sparse_param.prune(param, sparse_param.name)
        if param.requires_grad and sparse_param.grad_hook is None:
            sparse_param.grad_hook = param.register_hook(partial(self._grad_hook, param))

    def _grad_hook(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return torch.where(param._sparse_param.mask, grad, torch.zeros_like(grad))

    def sparsify_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if any(opt is optimizer for opt in self.sparse_optimizers) or getattr(optimizer, "is_sparse", False):
            return
        if self.sparse_optimizers:
            raise RuntimeError("Sparsifying multiple optimizers using the same sparsity algorithm is not supported.")
        self.sparse_optimizers.append(optimizer)
        optimizer.is_sparse = True
        optimizer.register_step_pre_hook(self._prune_optimizer_states)
        optimizer.register_step_post_hook(self._after_optimizer_step)

    @torch.no_grad()
    def _prune_optimizer_states(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = list(self.get_sparse_params(optimizer))
        if not params:
            raise RuntimeError("optimizer.apply(sparsity) was called but model.apply(sparsity) was not. "
                               "Please call model.apply(sparsity).")
        for sparse_param in params:
            param = sparse_param.param
            for state_name, state in optimizer.state.get(param, {}).items():
                if (isinstance(state, torch.Tensor) and state.shape == param.shape
                        and not getattr(state, "requires_dense", False)):
                    sparse_param.prune(state, state_name)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for sparse_param in self.get_sparse_params(optimizer):
            sparse_param.prune()
        if self.autoupdate:
            self.update(optimizer)

    @abstractmethod
    def update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Runs after every optimizer step while ``autoupdate`` is on."""

    # --------------------------------------------------------------------------- hooks
    def register_target_sparsity_hook(self, hook: Callable[[SparsityAlgorithm, str, Any], None]) -> RemovableHandle:
        """``hook(alg, name_glob, target)`` every optimizer step, once per distinct schedule."""
        handle = RemovableHandle(self._target_sparsity_hooks)
        self._target_sparsity_hooks[handle.id] = hook
        return handle

    def register_computed_sparsity_hook(self, hook: Callable[[SparsityAlgorithm, str, Any], None]) -> RemovableHandle:
        """``hook(alg, param_name, actual)`` every optimizer step, per parameter."""
        handle = RemovableHandle(self._computed_sparsity_hooks)
        self._computed_sparsity_hooks[handle.id] = hook
        return handle

    # ---------------------------------------------------------------------------- state
    def visit_state(self, fn: Callable[[torch.Tensor], Any]) -> None:
        pass

    def state_dict(self) -> Any:
        return {}

    def load_state_dict(self, state_dict: Any) -> None:
        pass

    def constant_level(self, param: torch.Tensor) -> float | None:
        """The configured level of ``param`` if it never changes, else None (used to check a
        mask loaded from a checkpoint)."""
        schedule = self.sparsity[param]
        return float(schedule.value) if isinstance(schedule, Constant) else None


class SparseParameter:
    """One sparsified parameter: its mask buffer, the tensors pruned by it this iteration, and
    its gradient hook. Reached as ``alg.sparse_params[name]`` and ``param._sparse_param``."""

    def __init__(self, module: nn.Module, name: str, init_method: Callable[..., torch.Tensor],
                 algorithm: SparsityAlgorithm) -> None:
        self.module = module
        self.name = name
        self.param_name = name.rsplit(".", 1)[-1]
        self.mask_name = f"{self.param_name}_mask"
        self.init_method = init_method
        self.algorithm = algorithm
        self.grad_hook: RemovableHandle | None = None
        self._initialized = False
        self._pruned: list[tuple[torch.Tensor, str]] = []
        module.register_buffer(self.mask_name, torch.ones_like(self.param, dtype=torch.bool), persistent=True)
        module._register_load_state_dict_pre_hook(self._before_load, with_module=False)
        module.register_load_state_dict_post_hook(lambda _module, _keys: self._after_load())
        self._loaded_mask = False

    @property
    def param(self) -> nn.Parameter:
        return self.module._parameters[self.param_name]

    @property
    def data(self) -> nn.Parameter:
        return self.param

    @property
    def mask(self) -> torch.Tensor:
        return self.module._buffers[self.mask_name]

    @mask.setter
    def mask(self, new_mask: torch.Tensor) -> None:
        self.update(new_mask)

    def initialize(self) -> None:
        if self._initialized:
            return
        mask = self.init_method(self.param)
        if not isinstance(mask, torch.Tensor) or mask.shape != self.param.shape:
            raise TypeError(f"{self.name}: init_method must return a tensor of shape {tuple(self.param.shape)}")
        self.module._buffers[self.mask_name] = mask.to(device=self.param.device, dtype=torch.bool)
        self._initialized = True

    @torch.no_grad()
    def prune(self, tensor: torch.Tensor | None = None, tensor_name: str | None = None) -> None:
        """Multiplies ``tensor`` by the mask and remembers it; no argument: all remembered."""
        if tensor is None:
            for remembered, _ in self._pruned:
                remembered.mul_(self.mask)
            return
        tensor.mul_(self.mask)
        if not any(t is tensor for t, _ in self._pruned):
            self._pruned.append((tensor, tensor_name or ""))

    def update(self, new_mask: torch.Tensor) -> None:
        if not self._initialized:
            raise RuntimeError("Detected that mask is being updated before it was initialized")
        if not self._pruned:
            raise RuntimeError("Detected that mask is being updated before it was used")
        if new_mask.shape != self.mask.shape:
            raise ValueError(f"{self.name}: new mask has shape {tuple(new_mask.shape)}, expected {tuple(self.mask.shape)}")
        self.mask.copy_(new_mask)
        self.prune()

    def clear(self) -> None:
        self._pruned.clear()

    # ---------------------------------------------------------------- checkpoint loading
    def _before_load(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # a dense weight keeps the placeholder mask and leaves initialisation to initialize()
        found = fill_missing_mask(state_dict, prefix, self.param_name, self.mask_name, self.mask)
        self._loaded_mask = found in ("mask", "nan")

    def _after_load(self) -> None:
        if not self._loaded_mask:
            return
        self._loaded_mask = False
        self._initialized = True
        level = self.algorithm.constant_level(self.param)
        if level is not None:
            self._apply_configured_level(level)

    @torch.no_grad()
    def _apply_configured_level(self, level: float) -> None:
        expected = make_mask_topk_sparsity(torch.zeros_like(self.param), level)
        kept, wanted = int(self.mask.sum()), int(expected.sum())
        if kept == wanted:
            return
        warnings.warn(
            f"{self.name}: the checkpoint's mask keeps {kept} of {self.mask.numel()} "
            f"(sparsity {1 - kept / self.mask.numel():.4f}); the configured sparsity is {level}. "
            f"Re-pruning to {wanted} by weight magnitude (cstorch would keep the checkpoint's level).",
            stacklevel=2,
        )
        score = torch.where(self.mask, self.param.abs().float(), torch.tensor(-1.0))
        self.mask.copy_(make_mask_topk_sparsity(score, level))

    def __repr__(self) -> str:
        return f"SparseParameter({self.name})"
