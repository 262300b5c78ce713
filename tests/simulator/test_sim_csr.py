"""CSR kernels and the autograd function against the masked dense computation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from simulator.csr import CSRStructure, csr_linear, resolve_backend
from simulator.native import load_kernels

BACKENDS = ["torch"] + (["native"] if load_kernels() is not None else [])


def random_problem(out_features, in_features, tokens, density, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(out_features, in_features, generator=gen) < density
    weight = (torch.randn(out_features, in_features, generator=gen, dtype=dtype) * mask)
    bias = torch.randn(out_features, generator=gen, dtype=dtype)
    x = torch.randn(*tokens, in_features, generator=gen, dtype=dtype)
    return mask, weight, bias, x


def run_both(mask, weight, bias, x, backend, dense_grad=False):
    """(csr outputs and grads, masked dense outputs and grads) for the same upstream gradient."""
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    y = csr_linear(leaves[0], leaves[1], leaves[2], CSRStructure.from_mask(mask),
                   dense_grad=dense_grad, backend=backend)
    upstream = torch.randn_like(y)
    y.backward(upstream)
    ref = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    y_ref = F.linear(ref[0], ref[1] * mask, ref[2])
    y_ref.backward(upstream)
    return (y, *[t.grad for t in leaves]), (y_ref, *[t.grad for t in ref]), upstream


def assert_close_rel(actual, expected, rel):
    actual, expected = actual.detach(), expected.detach()
    scale = expected.abs().max().clamp_min(1e-12)
    assert float((actual - expected).abs().max() / scale) <= rel


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,tokens,density", [
    ((32, 48), (70,), 0.2),      # tokens not a multiple of the kernel's token block
    ((64, 16), (2, 65), 0.05),   # leading dims, some empty rows
    ((8, 8), (1,), 1.0),         # full mask
    ((16, 24), (130,), 0.0),     # no non-zeros at all
], ids=["ragged", "leading-dims", "full", "empty"])
def test_csr_linear_matches_masked_dense_float32(backend, shape, tokens, density):
    mask, weight, bias, x = random_problem(*shape, tokens, density)
    (y, gx, gw, gb), (y_ref, gx_ref, gw_ref, gb_ref), _ = run_both(mask, weight, bias, x,
                                                                  backend)
    assert y.shape == y_ref.shape
    assert_close_rel(y, y_ref, 1e-5)
    assert_close_rel(gx, gx_ref, 1e-5)
    assert_close_rel(gw, gw_ref * mask, 1e-5)
    assert_close_rel(gb, gb_ref, 1e-5)
    assert not gw[~mask].any(), "sparse weight gradient must be zero off the mask"


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_grad_is_the_full_weight_gradient(backend):
    mask, weight, bias, x = random_problem(12, 20, (33,), 0.3)
    (_, _, gw, _), _, upstream = run_both(mask, weight, bias, x, backend, dense_grad=True)
    assert_close_rel(gw, upstream.t() @ x, 1e-5)   # dYᵀX everywhere, not only at the mask
    assert gw[~mask].abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend):
    mask, weight, bias, x = random_problem(5, 7, (6,), 0.5, dtype=torch.float64, seed=3)
    structure = CSRStructure.from_mask(mask)
    inputs = tuple(t.clone().requires_grad_(True) for t in (x, weight, bias))
    assert torch.autograd.gradcheck(
        lambda a, w, b: csr_linear(a, w, b, structure, backend=backend), inputs)


def test_structure_holds_both_orientations():
    mask = torch.tensor([[True, False, True], [False, False, False], [False, True, True]])
    s = CSRStructure.from_mask(mask)
    assert s.indptr.tolist() == [0, 2, 2, 4]
    assert s.cols.tolist() == [0, 2, 1, 2]
    assert s.flat_index.tolist() == [0, 2, 7, 8]
    assert s.indptr_t.tolist() == [0, 1, 2, 4]
    assert s.cols_t.tolist() == [0, 2, 0, 2]
    assert s.transpose_order.tolist() == [0, 2, 1, 3]  # Wᵀ's non-zeros in W's CSR order
    assert s.nnz == 4 and s.density == pytest.approx(4 / 9)
    assert s.row_nnz().tolist() == [2, 0, 2]


def test_bad_inputs_are_rejected_by_name():
    mask, weight, bias, x = random_problem(4, 6, (3,), 0.5)
    s = CSRStructure.from_mask(mask)
    with pytest.raises(TypeError, match="mask"):
        CSRStructure.from_mask(mask.float())
    with pytest.raises(ValueError, match="weight shape"):
        csr_linear(x, weight.t(), bias, s)
    with pytest.raises(ValueError, match="features"):
        csr_linear(x[:, :5], weight, bias, s)
    with pytest.raises(TypeError, match="dtype"):
        csr_linear(x.double(), weight, bias, s)
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda-magic", x)


def test_kernels_share_torchs_openmp_runtime_and_match_across_thread_counts():
    """Threads come from torch's libgomp (one OpenMP runtime in the process, so the kernels'
    threads never fight torch's spinning workers), and the row split is exact: 1 and 2 threads
    give bit-identical results."""
    assert load_kernels() is not None, "the C kernels did not build (gcc is a project requirement)"
    runtimes = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                if "libgomp" in line}
    assert len(runtimes) <= 1, f"two OpenMP runtimes loaded: {sorted(runtimes)}"
    generator = torch.Generator().manual_seed(0)
    mask = torch.rand(256, 512, generator=generator) > 0.8
    weight = torch.randn(256, 512, generator=generator) * mask
    x = torch.randn(300, 512, generator=generator)
    structure = CSRStructure.from_mask(mask)
    outputs = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outputs.append(csr_linear(x, weight, None, structure, backend="native"))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outputs[0], outputs[1])
    torch.testing.assert_close(outputs[0], F.linear(x, weight), rtol=1e-5, atol=1e-5)
