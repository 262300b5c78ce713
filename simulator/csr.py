"""CSR execution of a masked linear layer: ``Y = X Wᵀ + b`` touching only the kept weights.

A :class:`CSRStructure` built from the mask holds the CSR pattern of W and of Wᵀ plus the flat
positions of the non-zeros. The weight is given in one of two forms:
- the dense W (an ``nn.Parameter`` as optimizers, sparsity algorithms and state_dicts know it):
  every call gathers the current values (O(nnz)) and the weight gradient is dense (0 off the
  mask);
- the values, W's non-zeros in CSR order (``weight_values``; "weights as values"): no gather, and
  the weight gradient is values in the same order, so no dense gradient is zeroed or written
  (zeroing and writing it is 16 MiB at 4096 x 1024, whatever the sparsity).

A layout per direction (bench/roofline.py measures each against its bound):
- forward: Y = X Wᵀ by CSR SpMM over the CSR of W, O(nnz · tokens);
- backward: dX = dY W by CSR SpMM over the CSR of Wᵀ (built with W's at every mask change, its
  values a gather from W's), and dW only at the non-zeros, ``dW[k] = Σ_t dY[t, row_k] ·
  X[t, col_k]`` (a sampled dense-dense product over W's CSR), O(nnz · tokens);
- ``dense_grad=True`` (a RigL/GraNet update step; dense W only) returns the full ``dYᵀ X``
  instead, exactly what the masked dense layer would have produced before the sparsity library
  masks it.

Two backends: ``native`` (the C kernels of ``simulator.native``, float32/float64 on CPU) and
``torch`` (``torch.sparse.mm`` + ``torch.sparse.sampled_addmm``; any device torch supports).
The native backend runs a :class:`~simulator.native.KernelVariant` (its vector width, split or
fused backward, streamed or stored outputs), which ``simulator.crossover`` measures and chooses
per machine and shape; every variant gives the masked dense products within float rounding.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from simulator.native import DEFAULT_VARIANT, KernelLibrary, KernelVariant, load_kernels

Backend = Literal["auto", "native", "torch"]
BACKENDS = ("auto", "native", "torch")
# Weight values may be padded with zeros to a multiple of this many entries (their gradient is
# 0 there): torch's fused optimizer steps compute the last `length % vector width` entries of a
# tensor by scalar code that rounds differently from the vector code, so without padding the
# last non-zeros would drift from the same entries of a dense weight by an ulp now and then.
VALUES_ALIGNMENT = 64


def padded_length(nnz: int) -> int:
    """The length of weight values padded to :data:`VALUES_ALIGNMENT`."""
    return -(-nnz // VALUES_ALIGNMENT) * VALUES_ALIGNMENT


@dataclass(frozen=True)
class CSRStructure:
    """CSR pattern of a boolean mask of shape (out_features, in_features), and of its transpose.

    Index arrays are int32 (torch CSR and the C kernels both accept them); ``flat_index`` are
    the positions in ``weight.view(-1)`` of the non-zeros in CSR order of W, so its values are
    one gather from the dense parameter per call, and ``transpose_order`` the positions in that
    gathered array of the non-zeros in CSR order of Wᵀ (a gather from L2-sized data).
    """

    shape: tuple[int, int]
    indptr: torch.Tensor
    cols: torch.Tensor
    flat_index: torch.Tensor
    indptr_t: torch.Tensor
    cols_t: torch.Tensor
    transpose_order: torch.Tensor
    build_ms: float

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> "CSRStructure":
        if mask.dtype != torch.bool or mask.dim() != 2:
            raise TypeError(f"mask must be a 2-D bool tensor, got dtype={mask.dtype} "
                            f"with {mask.dim()} dims")
        if mask.numel() >= 2**31:
            raise ValueError(f"mask has {mask.numel()} elements; int32 CSR indices allow < 2**31")
        start = time.perf_counter()
        kernels = load_kernels() if mask.device.type == "cpu" else None
        if kernels is not None:
            arrays = kernels.csr_from_mask(mask.contiguous())
        else:
            arrays = _csr_arrays(mask)
        return cls(shape=tuple(mask.shape), **arrays,
                   build_ms=(time.perf_counter() - start) * 1e3)

    @property
    def nnz(self) -> int:
        return self.cols.numel()

    @property
    def density(self) -> float:
        return self.nnz / max(1, self.shape[0] * self.shape[1])

    def row_nnz(self) -> torch.Tensor:
        """Non-zeros per output row (what placement maps onto the PE grid)."""
        return (self.indptr[1:] - self.indptr[:-1]).to(torch.int64)


def _csr_arrays(mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``KernelLibrary.csr_from_mask`` in torch ops (any device, slower)."""
    out_features, in_features = mask.shape
    rows, cols = mask.nonzero(as_tuple=True)             # row-major order = CSR order
    transpose_order = torch.argsort(cols * out_features + rows)  # column-major = CSR of Wᵀ
    return {"indptr": _indptr(rows, out_features), "cols": cols.to(torch.int32),
            "flat_index": rows * in_features + cols,
            "indptr_t": _indptr(cols[transpose_order], in_features),
            "cols_t": rows[transpose_order].to(torch.int32), "transpose_order": transpose_order}


def _indptr(sorted_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    counts = torch.bincount(sorted_rows, minlength=num_rows)
    indptr = torch.zeros(num_rows + 1, dtype=torch.int64, device=sorted_rows.device)
    indptr[1:] = counts.cumsum(0)
    return indptr.to(torch.int32)


def resolve_backend(backend: Backend, x: torch.Tensor, variant: KernelVariant = DEFAULT_VARIANT
                    ) -> tuple[str, KernelLibrary | None]:
    """The backend that will run for input x: 'native' when the C kernels (built for
    `variant`) load and support it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch", None
    kernels = load_kernels(variant)
    usable = kernels is not None and kernels.supports(x)
    if backend == "native" and not usable:
        raise ValueError("backend='native' needs the compiled kernels and a float32/float64 CPU "
                         f"tensor; got {x.dtype} on {x.device}, kernels "
                         f"{'loaded' if kernels else 'unavailable'}")
    return ("native", kernels) if usable else ("torch", None)


def _csr_tensor(indptr, cols, vals, shape) -> torch.Tensor:
    with warnings.catch_warnings():  # torch warns that CSR is "beta" on every new process
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(indptr, cols, vals, shape, check_invariants=False)


class CSRLinearFunction(torch.autograd.Function):
    """Autograd function for ``csr_linear``; see the module docstring for the math. `weight` is
    the dense W (2-D) or its values in CSR order (1-D), and its gradient has the same form."""

    @staticmethod
    def forward(ctx, x, weight, bias, structure: CSRStructure, dense_grad: bool, backend: str,
                variant: KernelVariant):
        backend, kernels = resolve_backend(backend, x, variant)
        ctx.structure, ctx.dense_grad, ctx.backend, ctx.kernels, ctx.variant = (
            structure, dense_grad, backend, kernels, variant)
        ctx.has_bias = bias is not None
        ctx.values_given = weight.dim() == 1
        ctx.values_length = weight.numel()
        vals = (weight.detach() if ctx.values_given
                else weight_values(kernels, structure, weight.detach()))
        bias = None if bias is None else bias.detach()
        if backend == "native":
            y, packed_x = native_forward(kernels, structure, vals, bias, x, variant)
            ctx.save_for_backward(vals, x if dense_grad else None, packed_x)
            return y
        w_csr = _csr_tensor(structure.indptr, structure.cols, vals[:structure.nnz],
                            structure.shape)
        y = torch.sparse.mm(w_csr, x.t()).t()
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(vals, x, None)
        return y.contiguous()

    @staticmethod
    def backward(ctx, grad_y):
        vals, x, packed_x = ctx.saved_tensors
        structure: CSRStructure = ctx.structure
        grad_y = grad_y.contiguous()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        sampled_w = need_w and not ctx.dense_grad
        grad_x = grad_w = grad_b = None
        if ctx.backend == "native" and need_x and sampled_w and ctx.variant.fused_blocks:
            grad_x, grad_w, grad_b = native_fused_backward(
                ctx.kernels, structure, vals, grad_y, packed_x, ctx.variant, column_sums=need_b,
                dense=not ctx.values_given, length=ctx.values_length)
        elif ctx.backend == "native" and (need_x or sampled_w):
            # the bias gradient is dY's column sums, taken while packing dY (one pass less)
            if need_x:
                grad_x, packed_grad, grad_b = native_input_grad(ctx.kernels, structure, vals,
                                                                grad_y, column_sums=need_b,
                                                                variant=ctx.variant)
            else:
                packed = ctx.kernels.pack(grad_y, column_sums=need_b)
                packed_grad, grad_b = packed if need_b else (packed, None)
            if sampled_w:
                grad_w = native_weight_grad(ctx.kernels, structure, packed_grad, packed_x,
                                            dense=not ctx.values_given,
                                            length=ctx.values_length)
        elif ctx.backend == "torch":
            if need_x:
                vals_t = vals.index_select(0, structure.transpose_order)
                wt_csr = _csr_tensor(structure.indptr_t, structure.cols_t, vals_t,
                                     structure.shape[::-1])
                grad_x = torch.sparse.mm(wt_csr, grad_y.t()).t()
            if sampled_w:
                pattern = _csr_tensor(structure.indptr, structure.cols,
                                      torch.zeros(structure.nnz, dtype=x.dtype, device=x.device),
                                      structure.shape)
                grad_w = torch.sparse.sampled_addmm(pattern, grad_y.t(), x, beta=0.0).values()
                if not ctx.values_given:
                    grad_w = dense_weight(structure, grad_w)
                elif ctx.values_length > structure.nnz:
                    grad_w = torch.cat([grad_w, grad_w.new_zeros(ctx.values_length
                                                                 - structure.nnz)])
        if need_w and ctx.dense_grad:
            grad_w = grad_y.t().mm(x)
        if need_b and grad_b is None:
            grad_b = grad_y.sum(0)
        return grad_x, grad_w, grad_b, None, None, None, None


def weight_values(kernels: KernelLibrary | None, structure: CSRStructure,
                  weight: torch.Tensor) -> torch.Tensor:
    """The non-zero values of W in CSR order (by the C gather where the kernels run)."""
    if kernels is None:
        return weight.reshape(-1).index_select(0, structure.flat_index)
    return kernels.gather(weight.contiguous(), structure.flat_index)


def dense_weight(structure: CSRStructure, values: torch.Tensor) -> torch.Tensor:
    """The dense W holding `values` (CSR order) at the structure's non-zeros, 0 elsewhere: the
    inverse of :func:`weight_values`."""
    dense = torch.zeros(structure.shape[0] * structure.shape[1], dtype=values.dtype,
                        device=values.device)
    return dense.index_copy_(0, structure.flat_index.to(values.device),
                             values).view(structure.shape)


def native_forward(kernels: KernelLibrary, structure: CSRStructure, vals: torch.Tensor,
                   bias: torch.Tensor | None, x: torch.Tensor,
                   variant: KernelVariant = DEFAULT_VARIANT) -> tuple[torch.Tensor, torch.Tensor]:
    """Y = X (W ⊙ mask)ᵀ + b by the C kernels, for the non-zero values `vals` of W in CSR
    order; also returns X packed (the weight gradient reuses it)."""
    y, packed_x, _ = kernels.pack_spmm(x.contiguous(), structure.indptr, structure.cols, vals,
                                       None if bias is None else bias.contiguous(),
                                       stream=variant.stream)
    return y, packed_x


def native_input_grad(kernels: KernelLibrary, structure: CSRStructure, vals: torch.Tensor,
                      grad_y: torch.Tensor, column_sums: bool = False,
                      variant: KernelVariant = DEFAULT_VARIANT
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dX = dY (W ⊙ mask), by the CSR of Wᵀ over dY packed on the way: (dX, dY packed (the
    weight gradient reuses it), with column_sums=True dY's column sums (the bias gradient))."""
    vals_t = kernels.gather(vals, structure.transpose_order)
    return kernels.pack_spmm(grad_y, structure.indptr_t, structure.cols_t, vals_t, None,
                             column_sums=column_sums, stream=variant.stream)


def native_fused_backward(kernels: KernelLibrary, structure: CSRStructure, vals: torch.Tensor,
                          grad_y: torch.Tensor, packed_x: torch.Tensor, variant: KernelVariant,
                          column_sums: bool = False, dense: bool = False,
                          length: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dX and the sampled weight gradient in one pass over the CSR of Wᵀ (the "fused" and
    "fused2" variants): (dX, the weight gradient as values in CSR order zero padded to
    `length`, or with dense=True the dense dW, 0 off the mask; with column_sums=True dY's column sums)."""
    grad_x, grad_values, sums = kernels.backward(
        structure.indptr_t, structure.cols_t, kernels.gather(vals, structure.transpose_order),
        structure.transpose_order, grad_y, packed_x, column_sums=column_sums,
        length=None if dense else length, blocks_per_pass=variant.fused_blocks,
        stream=variant.stream, prefetch=variant.prefetch)
    if dense:
        return grad_x, kernels.dense_rows(structure.indptr, structure.cols, structure.shape[1],
                                          grad_values), sums
    return grad_x, grad_values, sums


def native_weight_grad(kernels: KernelLibrary, structure: CSRStructure,
                       packed_grad: torch.Tensor, packed_x: torch.Tensor,
                       dense: bool = False, length: int | None = None) -> torch.Tensor:
    """dW = dYᵀ X at the mask's non-zeros (a sampled dense-dense product): values in CSR order
    (zero padded to `length` entries), or with dense=True the dense dW, 0 off the mask."""
    return kernels.sddmm(structure.indptr, structure.cols, structure.shape[1], packed_grad,
                         packed_x, dense=dense, length=length)


def csr_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               structure: CSRStructure, *, dense_grad: bool = False,
               backend: Backend = "auto", variant: KernelVariant = DEFAULT_VARIANT
               ) -> torch.Tensor:
    """``x @ (weight ⊙ mask)ᵀ + bias`` in CSR, where ``structure`` was built from the mask.

    `weight` is the dense W (out_features, in_features) or its values in CSR order (nnz,), as
    :func:`weight_values` returns them, or those zero padded to ``padded_length(nnz)``; the
    weight gradient comes in the same form. x may have
    any leading dims; dense_grad=True (dense W only) makes the weight gradient the full dense
    ``dYᵀ X`` (for RigL/GraNet growth), otherwise it is non-zero only at the mask. `variant`
    picks how the native kernels run (``simulator.crossover`` chooses it per machine and shape;
    the default is the kernels before issue 46).
    """
    if weight.dim() == 1:
        if weight.numel() not in (structure.nnz, padded_length(structure.nnz)):
            raise ValueError(f"weight values have {weight.numel()} entries, the CSR structure "
                             f"{structure.nnz} non-zeros (padded: "
                             f"{padded_length(structure.nnz)}); rebuild it from the current mask")
        if dense_grad:
            raise ValueError("dense_grad=True needs the dense weight: a gradient for weight "
                             "values has entries at the non-zeros only")
    elif weight.shape != torch.Size(structure.shape):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match the CSR structure "
                         f"{structure.shape}; rebuild it from the current mask")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(f"x, weight and bias must share a dtype, got x={x.dtype}, "
                        f"weight={weight.dtype}, bias={None if bias is None else bias.dtype}")
    if x.shape[-1] != structure.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the layer expects {structure.shape[1]}")
    leading = x.shape[:-1]
    x2d = x.reshape(-1, structure.shape[1])
    y = CSRLinearFunction.apply(x2d, weight, bias, structure, dense_grad, backend, variant)
    return y.reshape(*leading, structure.shape[0])


def native_kernel_calls(kernels: KernelLibrary, structure: CSRStructure, weight: torch.Tensor,
                        x: torch.Tensor, grad_y: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The three native kernel calls of one forward+backward, as closures (bench/roofline.py).

    Packing an activation counts towards the kernel that first needs it (forward: X,
    input_grad: dY); the weight gradient reuses both packs, as the autograd function does.
    """
    vals = weight_values(kernels, structure, weight)
    packed_x, packed_grad = kernels.pack(x), kernels.pack(grad_y)
    return {
        "forward": lambda: native_forward(
            kernels, structure, weight_values(kernels, structure, weight), None, x),
        "input_grad": lambda: native_input_grad(kernels, structure, vals, grad_y),
        "weight_grad": lambda: native_weight_grad(kernels, structure, packed_grad, packed_x,
                                                  dense=True),
    }


def native_variant_calls(kernels: KernelLibrary, structure: CSRStructure, vals: torch.Tensor,
                         x: torch.Tensor, grad_y: torch.Tensor,
                         variant: KernelVariant) -> dict[str, Callable[[], object]]:
    """The forward and the backward of weights as values on `variant`'s kernels (the calls
    the autograd function makes), as closures (bench/roofline.py)."""
    packed_x = kernels.pack(x)
    if variant.fused_blocks:
        def backward() -> object:
            return native_fused_backward(kernels, structure, vals, grad_y, packed_x, variant)
    else:
        def backward() -> object:
            _, packed_grad, _ = native_input_grad(kernels, structure, vals, grad_y,
                                                  variant=variant)
            return native_weight_grad(kernels, structure, packed_grad, packed_x)
    return {"forward": lambda: native_forward(kernels, structure, vals, None, x, variant),
            "backward": backward}
