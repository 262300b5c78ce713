"""CSR layers on a live model: ``compile_model`` (``simulator.compile``) swaps masked ``nn.Linear`` for :class:`CSRLinear`.

The CSR layer holds the very same ``weight``/``bias`` Parameters and ``weight_mask`` buffer as the
linear layer it replaces, under the same attribute names, so optimizers, sparsity algorithms
(which update the mask in place with ``copy_``) and state_dict keys are unchanged. It watches the
mask's version counter and, after every mask write, re-runs the dense-vs-CSR rule of
``simulator.crossover`` for the new density and rebuilds its CSR structure, unless the write
left every row as it was (checked in O(nnz + rows) against the structure itself). The rebuild is
of the whole layer: a RigL update changes nearly every row (``LayerDecision.changed_rows``,
printed by bench/fabric_training.py), and the transposed CSR shifts with any change.

Weights as values (``compile(..., optimizer=...)``): on the steps that do not update a mask, the
live weights of a CSR layer are its non-zeros in CSR order (:attr:`CSRLinear.values`), a
parameter that takes the dense ``weight``'s place in the optimizer, with the optimizer's state
cut to the non-zeros. Forward and backward then read and write O(nnz): no gather of the values
out of W, no dense weight gradient (nor its masking), an optimizer step over the non-zeros only.
The dense ``weight`` is written back, and takes its place in the optimizer again (its state
scattered back, 0 off the mask, as the masked dense optimizer holds it), where something needs
it: ``state_dict()`` (the weight alone), the optimizer's ``state_dict()`` and
``load_state_dict()``, the layer's ``load_state_dict()``, a mask change, and a step that updates
masks (its forward runs on the dense weight, with the dense gradient RigL/GraNet grow from, so
the sparsity algorithm's update reads and writes the dense tensors it knows). So checkpoints,
resume, ``finalize`` and the cstorch API see what they see without it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from simulator.crossover import KernelCalibration, machine_calibration
from simulator.csr import (BACKENDS, Backend, CSRStructure, csr_linear, padded_length,
                           weight_values)
from simulator.native import DEFAULT_VARIANT, KernelVariant

logger = logging.getLogger(__name__)

KernelPolicy = Literal["auto", "csr", "dense"]
KERNEL_POLICIES = ("auto", "csr", "dense")
# Module hook tables shared (same dict objects) with the replaced layer, so hooks registered on
# it keep firing and their handles can still remove them.
SHARED_HOOK_TABLES = ("_forward_hooks", "_forward_hooks_with_kwargs",
                      "_forward_hooks_always_called", "_forward_pre_hooks",
                      "_forward_pre_hooks_with_kwargs")


@dataclass(frozen=True)
class LayerDecision:
    """Which kernel a layer runs and why, as of its last mask change."""

    name: str
    shape: tuple[int, int]
    density: float
    kernel: Literal["csr", "dense"]
    why: str
    tokens: int
    rebuilds: int
    last_rebuild_ms: float
    changed_rows: int  # rows whose kept weights the last mask write changed (all, at first)
    variant: str = DEFAULT_VARIANT.name  # the kernel variant a csr layer runs


class CSRLinear(nn.Module):
    """A masked linear layer executed in CSR (or dense, where the measured rule says so)."""

    def __init__(self, linear: nn.Linear, *, name: str = "", algorithm: Any = None,
                 kernel: KernelPolicy = "auto", backend: Backend = "auto",
                 tokens_hint: int = 512, calibration: KernelCalibration | None = None,
                 optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        super().__init__()
        mask = linear._buffers.get("weight_mask")
        if mask is None:
            raise ValueError(f"{name or 'layer'}: CSRLinear needs a `weight_mask` buffer")
        if mask.shape != linear.weight.shape or mask.dtype != torch.bool:
            raise ValueError(f"{name}: weight_mask must be bool with the weight's shape "
                             f"{tuple(linear.weight.shape)}, got {mask.dtype} "
                             f"{tuple(mask.shape)}")
        if kernel not in KERNEL_POLICIES:
            raise ValueError(f"kernel must be one of {KERNEL_POLICIES}, got {kernel!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.name, self.algorithm, self.policy, self.backend = name, algorithm, kernel, backend
        self.calibration = calibration
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        for buffer_name, buffer in linear._buffers.items():  # the mask and what tracks it
            self.register_buffer(buffer_name, buffer,
                                 persistent=buffer_name not in linear._non_persistent_buffers_set)
        for table in SHARED_HOOK_TABLES:
            setattr(self, table, getattr(linear, table))
        self._mask_key: tuple[int, int, int] | None = None
        self._structure: CSRStructure | None = None
        self._tokens = tokens_hint
        self.variant = DEFAULT_VARIANT
        self.rebuilds = 0
        self.decision: LayerDecision | None = None
        self.optimizers = tuple(optimizers)
        # The live values while the optimizers step them (None: the dense weight is live).
        self._set_values(None)
        if self.optimizers:
            self.register_state_dict_pre_hook(lambda module, *_: module.write_back())
            self._register_load_state_dict_pre_hook(lambda *_: self.use_dense_weight())
            for optimizer in self.optimizers:
                optimizer.register_state_dict_pre_hook(lambda _opt: self.use_dense_weight())
                optimizer.register_load_state_dict_pre_hook(
                    lambda _opt, _state: self.use_dense_weight())
        self.refresh(tokens_hint)

    def _apply(self, fn: Any, recurse: bool = True) -> CSRLinear:
        # Moving or casting the layer (model.to("cuda"), .double()) replaces its weight and mask:
        # the CSR structure and values built from the old ones are dropped with them, and the
        # next forward rebuilds what the new device needs.
        self.use_dense_weight()
        self._structure, self._mask_key = None, None
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        kernel = self.decision.kernel if self.decision else "?"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel={kernel}")

    def refresh(self, tokens: int) -> LayerDecision:
        """Re-read the mask: density, kernel choice and (for csr) the CSR structure."""
        mask = self.weight_mask
        row_counts = mask.sum(1)
        density = float(row_counts.sum()) / mask.numel()
        kernel, why, self.variant = self._choose(density, tokens)
        old = self._structure
        changed_rows = self.out_features if old is None else changed_row_count(old, mask,
                                                                                row_counts)
        rebuild_ms = 0.0
        self._structure = None
        if kernel == "csr" and changed_rows == 0:
            self._structure = old
        elif kernel == "csr":
            start = time.perf_counter()
            self._structure = CSRStructure.from_mask(mask)
            rebuild_ms = (time.perf_counter() - start) * 1e3
            self.rebuilds += 1
        self._mask_key = (id(mask), mask._version, mask.data_ptr())
        self._tokens = tokens
        self.decision = LayerDecision(self.name, (self.out_features, self.in_features), density,
                                      kernel, why, tokens, self.rebuilds, rebuild_ms,
                                      changed_rows, self.variant.name)
        logger.info("simulator: %s %s density=%.4f -> %s (%s; rebuild %.2f ms)", self.name,
                    self.decision.shape, density, kernel, why, rebuild_ms)
        return self.decision

    def _choose(self, density: float, tokens: int
                ) -> tuple[Literal["csr", "dense"], str, KernelVariant]:
        """The kernel, why, and the kernel variant a csr layer runs (the calibration's choice
        for this shape and density; the default variant without a calibration)."""
        if self.policy != "auto":  # a given calibration still picks the variant
            variant = (DEFAULT_VARIANT if self.calibration is None else
                       self.calibration.variant_for(self.out_features, self.in_features, density))
            return self.policy, f"forced by kernel={self.policy!r}", variant
        if density == 1.0:
            return "dense", "mask keeps every weight", DEFAULT_VARIANT
        if self.weight.is_cuda:
            return ("dense", "masked dense on CUDA (the CSR kernels are CPU kernels)",
                    DEFAULT_VARIANT)
        cal = self.calibration or machine_calibration(self.weight.device, self.weight.dtype,
                                                      self.backend)
        variant = cal.variant_for(self.out_features, self.in_features, density)
        nnz = round(density * self.out_features * self.in_features)
        csr_s = cal.predict_csr_s(self.out_features, self.in_features, nnz, tokens)
        dense_s = cal.predict_dense_s(self.out_features, self.in_features, tokens)
        kernel = "csr" if csr_s < dense_s else "dense"
        return kernel, (f"predicted fwd+bwd csr {csr_s * 1e3:.3g} ms vs dense "
                        f"{dense_s * 1e3:.3g} ms at {tokens} tokens (calibrated {cal.backend}, "
                        f"{cal.threads} threads, variant {variant.name}; crossover density "
                        f"{cal.crossover_density(self.out_features, self.in_features, tokens):.3f})"
                        ), variant

    @property
    def values(self) -> nn.Parameter | None:
        """The live weights as W's non-zeros in CSR order (zero padded to
        ``simulator.csr.padded_length(nnz)``), or None while the dense weight is live."""
        return self._values

    @torch.no_grad()
    def write_back(self) -> None:
        """Write the live values into the dense weight (off the mask it holds 0 already). Every
        time: fused optimizer steps write parameters without counting versions."""
        if self._values is not None:
            structure = self._structure
            self.weight.view(-1).index_copy_(0, structure.flat_index,
                                             self._values[:structure.nnz])

    def use_dense_weight(self) -> None:
        """Make the dense weight live again: the values written back, and the weight in their
        place in the optimizers, with their state scattered to the weight's shape."""
        values = self._values
        if values is None:
            return
        self.write_back()
        structure = self._structure

        def scatter(state: torch.Tensor) -> torch.Tensor:
            dense = torch.zeros(self.weight.numel(), dtype=state.dtype, device=state.device)
            return dense.index_copy_(0, structure.flat_index,
                                     state[:structure.nnz]).view_as(self.weight)

        for optimizer in self.optimizers:
            _replace_parameter(optimizer, values, self.weight, scatter)
        self._set_values(None)

    def _use_values(self) -> None:
        """Make the values live: gathered from the dense weight, in its place in the optimizers
        with its state gathered the same way."""
        structure = self._structure

        def gather(dense: torch.Tensor) -> torch.Tensor:
            padded = dense.new_zeros(padded_length(structure.nnz))
            padded[:structure.nnz] = weight_values(None, structure, dense.detach())
            return padded

        values = nn.Parameter(gather(self.weight))
        for optimizer in self.optimizers:
            _replace_parameter(optimizer, self.weight, values, gather)
        self._set_values(values)
        # A dense gradient left from the update step: no optimizer would clear it any more.
        self.weight.grad = None

    def _set_values(self, values: nn.Parameter | None) -> None:
        # Not a registered parameter: state_dict() and parameters() stay those of the dense layer.
        self.__dict__["_values"] = values

    def _updates_masks_after_this_step(self) -> bool:
        algorithm = self.algorithm
        return algorithm is not None and algorithm.is_update_step(algorithm.step + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.weight_mask
        if self._mask_key != (id(mask), mask._version, mask.data_ptr()):
            self.use_dense_weight()  # the values follow the structure about to be replaced
            self.refresh(max(1, x.numel() // self.in_features))
        if self._structure is None:
            return F.linear(x, self.weight, self.bias)
        if self.optimizers and torch.is_grad_enabled():
            if self._updates_masks_after_this_step():
                self.use_dense_weight()
            elif self._values is None:
                self._use_values()
        dense_grad = bool(torch.is_grad_enabled() and self.algorithm is not None
                          and self.algorithm.needs_dense_grad())
        weight, bias = (self.weight if self._values is None else self._values), self.bias
        if torch.is_autocast_enabled(x.device.type):
            # The CSR kernels run in the parameters' precision; autocast casts downstream ops.
            with torch.autocast(x.device.type, enabled=False):
                return csr_linear(x.to(weight.dtype), weight, bias, self._structure,
                                  dense_grad=dense_grad, backend=self.backend,
                                  variant=self.variant)
        return csr_linear(x, weight, bias, self._structure, dense_grad=dense_grad,
                          backend=self.backend, variant=self.variant)


def _replace_parameter(optimizer: torch.optim.Optimizer, old: torch.Tensor, new: torch.Tensor,
                       convert) -> None:
    """Put `new` in `old`'s place in `optimizer`'s groups; its state tensors of `old`'s shape
    (moments, momentum) go through `convert`, the rest (step counts) as they are."""
    for group in optimizer.param_groups:
        params = group["params"]
        for i, param in enumerate(params):
            if param is old:
                params[i] = new
    state = optimizer.state.pop(old, None)
    if state:
        optimizer.state[new] = {
            key: convert(value) if isinstance(value, torch.Tensor) and value.shape == old.shape
            else value for key, value in state.items()}


def changed_row_count(structure: CSRStructure, mask: torch.Tensor,
                      row_counts: torch.Tensor) -> int:
    """Rows of `mask` (with per-row counts `row_counts`) that differ from `structure`'s pattern.

    A row is unchanged exactly when it keeps all of its old non-zeros and has as many as before,
    so one gather over the old non-zeros decides it, without a copy of the old mask."""
    old_counts = structure.row_nnz().to(mask.device)
    kept = mask.reshape(-1)[structure.flat_index]
    old_rows = torch.repeat_interleave(torch.arange(structure.shape[0], device=mask.device),
                                       old_counts)
    changed = row_counts != old_counts
    changed[old_rows[~kept]] = True
    return int(changed.sum())


def _check_algorithm(algorithm: Any) -> None:
    if algorithm is not None and not callable(getattr(algorithm, "needs_dense_grad", None)):
        raise TypeError("algorithm must provide needs_dense_grad() -> bool (a sparsity "
                        f"algorithm) or be None, got {type(algorithm).__name__}")


def _check_values_optimizer(optimizer: Any, algorithm: Any) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    # The layers switch to the dense weight for the steps that update masks (and only then).
    if algorithm is not None and not (callable(getattr(algorithm, "is_update_step", None))
                                      and hasattr(algorithm, "step")):
        raise TypeError("optimizer (weights as values) needs an algorithm with "
                        "is_update_step(step) and step (a sparsity algorithm), got "
                        f"{type(algorithm).__name__}")


def compile_model(model: nn.Module, algorithm: Any = None, *, kernel: KernelPolicy = "auto",
                  backend: Backend = "auto", tokens: int = 512,
                  calibration: KernelCalibration | None = None,
                  optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
    """Swap every masked ``nn.Linear`` of `model` (in place) for a :class:`CSRLinear`.

    Call it after ``algorithm.apply(model)`` so the masks exist. `algorithm` tells the layers
    when a dense weight gradient is needed (``needs_dense_grad()``); `kernel` forces "csr" or
    "dense" instead of the measured rule; `tokens` is the batch size in tokens assumed for the
    first decision (later ones use the real batch); `calibration` replaces this machine's
    measurement (``simulator.crossover.machine_calibration``);
    `optimizer` (the one stepping `model`'s parameters, hooked by `algorithm`) makes the CSR
    layers' weights values (see the module docstring): it steps their non-zeros only, and holds
    the dense weights again whenever something reads them.

    Args:
        model: A model whose sparse linear layers carry a ``weight_mask`` buffer, or one such
            layer.
        algorithm: The sparsity algorithm applied to `model`, or None (weight gradients then
            stay masked).
        kernel: ``"auto"`` (the measured crossover rule), ``"csr"`` or ``"dense"``.
        backend: ``"auto"``, ``"native"`` (the C kernels) or ``"torch"``.
        tokens: Tokens per batch assumed for the first decision.
        calibration: A fixed crossover calibration instead of measuring one.
        optimizer: The optimizer of `model`, or None (the CSR layers then compute on the
            dense weights, gathering their non-zeros every call). A layer learns that a step
            updates masks in that step's forward, so every step needs a forward with
            gradients enabled (a training step has one) before ``optimizer.step()``.

    Returns:
        The model, changed in place (or the CSR layer when `model` itself is a masked linear
        layer).

    Raises:
        TypeError: `algorithm` has no ``needs_dense_grad()``; with `optimizer`, `algorithm`
            has no ``is_update_step(step)`` and ``step`` or `optimizer` is no optimizer.
        ValueError: `tokens` is not a positive int.
    """
    _check_algorithm(algorithm)
    if optimizer is not None:
        _check_values_optimizer(optimizer, algorithm)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    options = dict(algorithm=algorithm, kernel=kernel, backend=backend, tokens_hint=tokens,
                   calibration=calibration, optimizers=() if optimizer is None else (optimizer,))
    if _is_masked_linear(model):
        return _swap(model, CSRLinear(model, name="", **options), algorithm)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if _is_masked_linear(child):
                full_name = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name,
                        _swap(child, CSRLinear(child, name=full_name, **options), algorithm))
    return model


def _swap(linear: nn.Linear, layer: CSRLinear, algorithm: Any) -> CSRLinear:
    """The algorithm reads its masks and parameters from the module that holds them: from now
    on the CSR layer, so a later ``model.to(device)`` moves what it reads."""
    for sp in getattr(algorithm, "sparse_params", {}).values():
        if getattr(sp, "module", None) is linear:
            sp.module = layer
    return layer


def _is_masked_linear(module: nn.Module) -> bool:
    return (isinstance(module, nn.Linear) and "weight_mask" in module._buffers
            and not getattr(module, "requires_dense", False))


def decisions(model: nn.Module) -> list[LayerDecision]:
    """The current kernel decision of every CSR layer in `model`, in module order."""
    return [module.decision for module in model.modules()
            if isinstance(module, CSRLinear) and module.decision is not None]
