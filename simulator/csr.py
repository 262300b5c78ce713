"""CSR execution of a masked linear layer: ``Y = X Wᵀ + b`` touching only the kept weights.

The weight stays a dense ``nn.Parameter`` (so optimizers, sparsity algorithms and state_dicts are
unchanged); a :class:`CSRStructure` built from the mask holds the CSR pattern of W and of Wᵀ plus
the flat positions of the non-zeros, and every call gathers the current values (O(nnz)).

- forward: Y = X Wᵀ by CSR SpMM, O(nnz · tokens);
- backward: dX = dY W by CSR SpMM with Wᵀ (its pattern precomputed at rebuild), and dW only at
  the non-zeros, ``dW[k] = Σ_t dY[t, row_k] · X[t, col_k]`` (a sampled product), O(nnz · tokens);
- ``dense_grad=True`` (a RigL/GraNet update step) returns the full ``dYᵀ X`` instead, exactly what
  the masked dense layer would have produced before the sparsity library masks it.

Two backends: ``native`` (the C kernels of ``simulator.native``, float32/float64 on CPU) and
``torch`` (``torch.sparse.mm`` + ``torch.sparse.sampled_addmm``; any device torch supports).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from collections.abc import Callable
from typing import Literal

import torch

from simulator.native import KernelLibrary, load_kernels

Backend = Literal["auto", "native", "torch"]
BACKENDS = ("auto", "native", "torch")


@dataclass(frozen=True)
class CSRStructure:
    """CSR pattern of a boolean mask of shape (out_features, in_features), and of its transpose.

    Index arrays are int32 (torch CSR and the C kernels both accept them); ``flat_index`` and
    ``flat_index_t`` are the positions in ``weight.view(-1)`` of the non-zeros in CSR order of W
    and of Wᵀ, so values are a gather from the dense parameter.
    """

    shape: tuple[int, int]
    indptr: torch.Tensor
    cols: torch.Tensor
    flat_index: torch.Tensor
    indptr_t: torch.Tensor
    cols_t: torch.Tensor
    flat_index_t: torch.Tensor
    build_ms: float

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> "CSRStructure":
        if mask.dtype != torch.bool or mask.dim() != 2:
            raise TypeError(f"mask must be a 2-D bool tensor, got dtype={mask.dtype} "
                            f"with {mask.dim()} dims")
        if mask.numel() >= 2**31:
            raise ValueError(f"mask has {mask.numel()} elements; int32 CSR indices allow < 2**31")
        start = time.perf_counter()
        out_features, in_features = mask.shape
        rows, cols = mask.nonzero(as_tuple=True)             # row-major order = CSR order
        cols_t_major, rows_t = mask.t().nonzero(as_tuple=True)  # column-major order = CSR of Wᵀ
        structure = cls(
            shape=(out_features, in_features),
            indptr=_indptr(rows, out_features),
            cols=cols.to(torch.int32),
            flat_index=rows * in_features + cols,
            indptr_t=_indptr(cols_t_major, in_features),
            cols_t=rows_t.to(torch.int32),
            flat_index_t=rows_t * in_features + cols_t_major,
            build_ms=0.0,
        )
        object.__setattr__(structure, "build_ms", (time.perf_counter() - start) * 1e3)
        return structure

    @property
    def nnz(self) -> int:
        return self.cols.numel()

    @property
    def density(self) -> float:
        return self.nnz / max(1, self.shape[0] * self.shape[1])

    def row_nnz(self) -> torch.Tensor:
        """Non-zeros per output row (what placement maps onto the PE grid)."""
        return (self.indptr[1:] - self.indptr[:-1]).to(torch.int64)


def _indptr(sorted_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    counts = torch.bincount(sorted_rows, minlength=num_rows)
    indptr = torch.zeros(num_rows + 1, dtype=torch.int64, device=sorted_rows.device)
    indptr[1:] = counts.cumsum(0)
    return indptr.to(torch.int32)


def resolve_backend(backend: Backend, x: torch.Tensor) -> tuple[str, KernelLibrary | None]:
    """The backend that will run for input x: 'native' when the C kernels load and support it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch", None
    kernels = load_kernels()
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
    """Autograd function for ``csr_linear``; see the module docstring for the math."""

    @staticmethod
    def forward(ctx, x, weight, bias, structure: CSRStructure, dense_grad: bool, backend: str):
        backend, kernels = resolve_backend(backend, x)
        in_features = structure.shape[1]
        flat_weight = weight.detach().reshape(-1)
        vals = flat_weight.index_select(0, structure.flat_index)
        ctx.structure, ctx.dense_grad, ctx.backend, ctx.kernels = (
            structure, dense_grad, backend, kernels)
        ctx.tokens = x.shape[0]
        ctx.has_bias = bias is not None
        keep_x = dense_grad or backend == "torch"
        if backend == "native":
            packed_x = kernels.pack(x.contiguous())
            detached_bias = None if bias is None else bias.detach().contiguous()
            y = kernels.spmm(structure.indptr, structure.cols, vals, detached_bias,
                             in_features, packed_x, x.shape[0])
            ctx.save_for_backward(weight, x if keep_x else None, packed_x)
        else:
            w_csr = _csr_tensor(structure.indptr, structure.cols, vals, structure.shape)
            y = torch.sparse.mm(w_csr, x.t()).t()
            if bias is not None:
                y = y + bias.detach()
            y = y.contiguous()
            ctx.save_for_backward(weight, x, None)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        weight, x, packed_x = ctx.saved_tensors
        structure: CSRStructure = ctx.structure
        out_features, in_features = structure.shape
        grad_y = grad_y.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias
        grad_x = grad_w = grad_b = None
        packed_grad = None
        if ctx.backend == "native" and (need_x or (need_w and not ctx.dense_grad)):
            packed_grad = ctx.kernels.pack(grad_y)
        if need_x:
            vals_t = weight.detach().reshape(-1).index_select(0, structure.flat_index_t)
            if ctx.backend == "native":
                grad_x = ctx.kernels.spmm(structure.indptr_t, structure.cols_t, vals_t, None,
                                          out_features, packed_grad, ctx.tokens)
            else:
                wt_csr = _csr_tensor(structure.indptr_t, structure.cols_t, vals_t,
                                     (in_features, out_features))
                grad_x = torch.sparse.mm(wt_csr, grad_y.t()).t()
        if need_w:
            if ctx.dense_grad:
                grad_w = grad_y.t().mm(x)
            else:
                if ctx.backend == "native":
                    values = ctx.kernels.sddmm(structure.indptr, structure.cols, in_features,
                                               packed_grad, packed_x)
                else:
                    pattern = _csr_tensor(structure.indptr, structure.cols,
                                          torch.zeros(structure.nnz, dtype=x.dtype,
                                                      device=x.device), structure.shape)
                    values = torch.sparse.sampled_addmm(pattern, grad_y.t(), x,
                                                        beta=0.0).values()
                grad_w = torch.zeros(out_features * in_features, dtype=values.dtype,
                                     device=values.device)
                grad_w.index_copy_(0, structure.flat_index, values)
                grad_w = grad_w.view(out_features, in_features)
        if need_b and ctx.needs_input_grad[2]:
            grad_b = grad_y.sum(0)
        return grad_x, grad_w, grad_b, None, None, None


def csr_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               structure: CSRStructure, *, dense_grad: bool = False,
               backend: Backend = "auto") -> torch.Tensor:
    """``x @ (weight ⊙ mask)ᵀ + bias`` in CSR, where ``structure`` was built from the mask.

    x may have any leading dims; dense_grad=True makes the weight gradient the full dense
    ``dYᵀ X`` (for RigL/GraNet growth), otherwise it is non-zero only at the mask.
    """
    if weight.shape != torch.Size(structure.shape):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match the CSR structure "
                         f"{structure.shape}; rebuild it from the current mask")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(f"x, weight and bias must share a dtype, got x={x.dtype}, "
                        f"weight={weight.dtype}, bias={None if bias is None else bias.dtype}")
    if x.shape[-1] != structure.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the layer expects {structure.shape[1]}")
    leading = x.shape[:-1]
    x2d = x.reshape(-1, structure.shape[1])
    y = CSRLinearFunction.apply(x2d, weight, bias, structure, dense_grad, backend)
    return y.reshape(*leading, structure.shape[0])


def native_kernel_calls(kernels: KernelLibrary, structure: CSRStructure, weight: torch.Tensor,
                        x: torch.Tensor, grad_y: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The three native kernel calls of one forward+backward, as closures (bench/roofline.py).

    Packing an activation counts towards the kernel that first needs it (forward: X,
    input_grad: dY); the weight gradient reuses both packs, as the autograd function does.
    """
    in_features = structure.shape[1]
    out_features = structure.shape[0]
    vals = weight.reshape(-1).index_select(0, structure.flat_index)
    vals_t = weight.reshape(-1).index_select(0, structure.flat_index_t)
    packed_x, packed_grad = kernels.pack(x), kernels.pack(grad_y)
    tokens = x.shape[0]
    return {
        "forward": lambda: kernels.spmm(structure.indptr, structure.cols, vals, None,
                                        in_features, kernels.pack(x), tokens),
        "input_grad": lambda: kernels.spmm(structure.indptr_t, structure.cols_t, vals_t, None,
                                           out_features, kernels.pack(grad_y), tokens),
        "weight_grad": lambda: kernels.sddmm(structure.indptr, structure.cols, in_features,
                                             packed_grad, packed_x),
    }
