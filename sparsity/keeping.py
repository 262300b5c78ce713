"""Keeping masked entries at zero: weights, gradients (a hook in backward) and optimizer state.

``MaskKeeper`` is the half of :class:`~sparsity.SparsityAlgorithm` that runs every step: the
gradient hooks (mask at the end of each backward pass, capturing the dense gradient first
before an update step), the
optimizer's pre- and post-step hooks, and the zeroing an update needs. It reads the algorithm's
``_params``, ``_optimizers``, ``step``, ``autoupdate``, ``needs_dense_grad()`` and ``update()``.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .masks import apply_mask_, apply_masks_

__all__ = ["SparseParam", "MaskKeeper"]


@dataclass(eq=False)
class SparseParam:
    """A masked parameter: its name relative to the model root and the module holding it.

    As in cstorch, ``data`` is the parameter's tensor and ``sparse_param.mask = new_mask`` sets
    the mask (copied into the ``<param>_mask`` buffer, so the model's state_dict and every layer
    sharing that buffer see it). The parameter and its mask are read from the module each time,
    never kept: ``model.to(device)`` may replace either (a conversion to ``meta``, or torch's
    ``overwrite_module_params_on_conversion``), and what the algorithm holds must follow the
    model to its device.
    """

    name: str
    module: nn.Module
    param_name: str
    mask_name: str = field(init=False, repr=False)  # the buffer's name, `<param_name>_mask`

    def __post_init__(self) -> None:
        self.mask_name = f"{self.param_name}_mask"  # read on every step: made once

    @property
    def param(self) -> nn.Parameter:
        return self.module._parameters[self.param_name]

    @property
    def mask(self) -> torch.Tensor:
        return self.module._buffers[self.mask_name]

    @mask.setter
    def mask(self, new_mask: torch.Tensor) -> None:
        if new_mask.shape != self.param.shape:
            raise ValueError(f"{self.name}: a mask needs the parameter's shape {tuple(self.param.shape)}, "
                             f"got {tuple(new_mask.shape)}")
        self.mask.copy_(new_mask.to(torch.bool))

    @property
    def data(self) -> torch.Tensor:
        return self.param.data


def weak_hook(method: Any) -> Any:
    """A tensor hook calling the bound `method` while its object lives. Torch keeps a tensor's
    hooks on its C++ side, out of the garbage collector's sight: a hook holding the algorithm,
    which holds the tensor, made a cycle no collection frees, so every model built and dropped
    stayed in memory (a service planning jobs grew by a meta model per job)."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return hook


def fill_missing_mask(state_dict: dict[str, Any], prefix: str, param_name: str, mask_name: str,
                      current_mask: torch.Tensor) -> str:
    """Lets a plain ``load_state_dict`` of a masked module read a checkpoint without a
    ``<param>_mask`` entry, in place: a weight holding NaN (cstorch 1.x's sentinel for pruned
    positions) gets the mask ``isfinite(weight)`` and 0 at those positions; a dense weight gets
    ``current_mask`` (the algorithm keeps its own mask). Returns ``"mask"`` (the checkpoint has
    one), ``"nan"``, ``"dense"``, or ``""`` (no such weight)."""
    mask_key, weight_key = prefix + mask_name, prefix + param_name
    if mask_key in state_dict:
        return "mask"
    weight = state_dict.get(weight_key)
    if not isinstance(weight, torch.Tensor):
        return ""
    if weight.is_floating_point() and bool(torch.isnan(weight).any()):
        state_dict[mask_key] = torch.isfinite(weight)
        state_dict[weight_key] = torch.nan_to_num(weight, nan=0.0)
        return "nan"
    state_dict[mask_key] = current_mask.detach().clone()
    return "dense"


class MaskKeeper:
    """Step-by-step masking for a sparsity algorithm (see the module docstring)."""

    _params: list[SparseParam]
    _optimizers: list[torch.optim.Optimizer]
    _grad_handles: list[RemovableHandle]
    _dense_grads: dict[nn.Parameter, torch.Tensor]
    # id(state tensor), or a parameter's name for its gradient (a new tensor each step) ->
    # (weak references to the tensor and to the mask, _stamp when we masked it)
    _masked_state: dict[int | str, tuple[weakref.ref, weakref.ref, tuple[int, ...]]]
    # per optimizer (by id): each mask's _stamp when a step began with zeros at masked positions
    _zeros_in: dict[int, dict[str, tuple[int, ...]]]
    _masking_task: int  # the autograd graph task whose end will mask the gradients

    def _hook_gradients(self) -> None:
        for handle in self._grad_handles:  # a re-applied algorithm hooks each parameter once
            handle.remove()
        self._grad_handles = [sp.param.register_post_accumulate_grad_hook(weak_hook(self._on_grad_accumulated))
                              for sp in self._params]

    def _on_grad_accumulated(self, param: nn.Parameter) -> None:
        # The first sparse gradient of a backward pass queues one callback for its end, which
        # masks every gradient in one in-place pass (the sum of masked contributions is the
        # same). Masking each gradient here, between backward's own kernels, measured several
        # times slower (about 5% of a training step instead of under 1%).
        task = torch._C._current_graph_task_id()
        if task != self._masking_task:
            self._masking_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    @torch.no_grad()
    def _after_backward(self) -> None:
        """End of a backward pass: add each new gradient's dense part to the capture if the next
        step grows by gradient, then zero it outside the mask."""
        capture = self.needs_dense_grad()
        new = []
        for sp in self._params:
            grad, mask = sp.param.grad, sp.mask
            if grad is None or self._still_masked(grad, mask, sp.name):
                continue  # no contribution from this backward
            if capture:
                self._add_dense_grad(sp, grad)
            new.append((mask, grad, sp.name))
        self._mask_and_record(new)

    def _add_dense_grad(self, sp: SparseParam, grad: torch.Tensor) -> None:
        """Adds this backward's dense contribution: ``grad`` is the gradient just accumulated,
        masked before this backward, so outside the mask it holds this backward's part alone."""
        total = self._dense_grads.get(sp.param)
        if total is None:
            self._dense_grads[sp.param] = grad.detach().clone()
        else:
            total.copy_(torch.where(sp.mask, grad, total + grad))

    @torch.no_grad()
    def mask_weights(self) -> None:
        for sp in self._params:
            self._mask_weight(sp)

    def _mask_weight(self, sp: SparseParam) -> None:
        apply_mask_(sp.mask, sp.param)
        self._record_masked(sp.param, sp.mask, _weight_key(sp))

    def _record_masked(self, value: torch.Tensor, mask: torch.Tensor, key: int | str | None = None) -> None:
        self._masked_state[id(value) if key is None else key] = (
            weakref.ref(value), weakref.ref(mask), _stamp(value, mask))

    @torch.no_grad()
    def _mask_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Mask every state tensor of a sparse parameter's shape, except states provably masked
        already: the same tensor under the same mask, neither written since we masked it (a
        loaded optimizer state is a new tensor, a loaded mask a write). So this pre-step pass
        costs nothing after the post-step pass of the previous step."""
        stale = []
        for sp in self._params:
            param, mask = sp.param, sp.mask
            stale += [(mask, value, None) for value in optimizer.state.get(param, {}).values()
                      if _is_state_like(value, param) and not self._still_masked(value, mask)]
        self._mask_and_record(stale)

    def _still_masked(self, value: torch.Tensor, mask: torch.Tensor, key: int | str | None = None) -> bool:
        entry = self._masked_state.get(id(value) if key is None else key)
        return (entry is not None and entry[0]() is value and entry[1]() is mask
                and entry[2] == _stamp(value, mask))

    def _mask_tensors(self, mask: torch.Tensor, tensors: list[torch.Tensor],
                      states: list[torch.Tensor]) -> None:
        apply_mask_(mask, *tensors, *states)
        for value in states:
            self._record_masked(value, mask)

    def _mask_and_record(self, items: list[tuple[torch.Tensor, torch.Tensor, int | str | None]]) -> None:
        """Zero each ``(mask, tensor, key)``'s tensor outside its mask, all in one pass
        (``apply_masks_``), and record it as masked under its key."""
        apply_masks_([(mask, tensor) for mask, tensor, _ in items])
        for mask, tensor, key in items:
            self._record_masked(tensor, mask, key)

    @torch.no_grad()
    def mask_gradients(self) -> None:
        """Zero gradients outside the masks that backward did not produce (assigned by hand,
        or changed in place since), capturing them first as the dense gradient if the next
        step grows by gradient. Gradients from backward are masked by the hooks already, so
        this costs nothing for them; the optimizer pre-step hook calls it too.
        """
        capture = self.needs_dense_grad()
        changed = []
        for sp in self._params:
            param, mask = sp.param, sp.mask
            grad = param.grad
            if capture and param not in self._dense_grads:
                self._dense_grads[param] = (torch.zeros_like(param) if grad is None
                                            else grad.detach().clone())
            if grad is not None and not self._still_masked(grad, mask, sp.name):
                changed.append((mask, grad, sp.name))
        self._mask_and_record(changed)

    def captured_dense_grads(self) -> list[torch.Tensor]:
        """The dense gradients captured for the coming update step (empty on other steps), to
        all-reduce with the gradients under data parallelism so every replica grows alike.
        In the algorithm's parameter order, so every replica lists them alike."""
        return [self._dense_grads[sp.param] for sp in self._params if sp.param in self._dense_grads]

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.mask_gradients()
        self._mask_optimizer_state(optimizer)
        if _keeps_zeros(optimizer):
            # Gradient, state and weight are now 0 at every masked position, so this step writes
            # 0 there too; remember each mask's version to know after the step it did not move.
            zeros_in, unmasked = {}, []
            for sp in self._params:
                param, mask, key = sp.param, sp.mask, _weight_key(sp)
                if not self._still_masked(param, mask, key):
                    unmasked.append((mask, param, key))
                zeros_in[sp.name] = _stamp(mask, mask)
            self._mask_and_record(unmasked)
            self._zeros_in[id(optimizer)] = zeros_in

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer is self._optimizers[0]:  # several optimizers: the first one counts steps
            self.step += 1
            if self.autoupdate and self._update_takes_optimizer:
                self.update(optimizer=optimizer)
            elif self.autoupdate:
                self.update()
            self._dense_grads = {}
        zeros_in = self._zeros_in.pop(id(optimizer), {})
        zeroing, kept = [], []  # (mask, tensor, key): to mask, and masked already
        for sp in self._params:
            param, mask = sp.param, sp.mask
            states = [(mask, value, None) for value in optimizer.state.get(param, {}).values()
                      if _is_state_like(value, param)]
            if zeros_in.get(sp.name) == _stamp(mask, mask):
                # zeros in, zeros out, under an unchanged mask: record it instead of masking
                kept += [(mask, param, _weight_key(sp)), *states]
            else:
                zeroing.append((mask, param, _weight_key(sp)))
                for item in states:
                    (kept if self._still_masked(item[1], mask) else zeroing).append(item)
        self._mask_and_record(zeroing)
        for mask, tensor, key in kept:
            self._record_masked(tensor, mask, key)

    @torch.no_grad()
    def zero_outside(self, param: nn.Parameter, mask: torch.Tensor) -> None:
        """Zero weight, gradient and same-shaped optimizer state of ``param`` outside the bool
        ``mask`` (the parameter's shape): entries an update deactivates hold zeros, entries
        active before and after keep theirs."""
        tensors = [param] if param.grad is None else [param, param.grad]
        states = [value for optimizer in self._optimizers
                  for value in optimizer.state.get(param, {}).values() if _is_state_like(value, param)]
        self._mask_tensors(mask, tensors, states)


def _stamp(state: torch.Tensor, mask: torch.Tensor) -> tuple[int, ...]:
    """What "still masked" rests on: the memory each tensor holds, and its count of in-place
    writes (``_version``)."""
    return state.data_ptr(), state._version, mask.data_ptr(), mask._version


# torch.optim steps that are elementwise and leave an entry whose gradient, state and weight
# are all 0 at exactly 0, state included (weight decay, momentum and Adam's moments all scale
# those zeros; Adamax is out: it writes eps into its state). A subclass that overrides step(),
# LBFGS and the rest get the masking pass after every step.
_ZERO_KEEPING_STEPS = frozenset(
    inspect.unwrap(cls.step) for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                         torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.RAdam, torch.optim.NAdam))


def _keeps_zeros(optimizer: torch.optim.Optimizer) -> bool:
    return _class_keeps_zeros(type(optimizer))


@functools.cache
def _class_keeps_zeros(cls: type) -> bool:
    # unwrapped: torch wraps an optimizer class's step() (profiling hooks) on first use
    step = getattr(cls, "step", None)
    return step is not None and inspect.unwrap(step) in _ZERO_KEEPING_STEPS


def _weight_key(sp: SparseParam) -> str:
    return sp.name + "/weight"  # parameter names hold no "/", so this never meets a gradient's key


def _is_state_like(value: Any, param: torch.Tensor) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.shape == param.shape
        and not getattr(value, "requires_dense", False)
    )
