"""Property tests of the C kernels and csr_linear against dense torch over random problems.

Shapes cross the kernels' internal tile sizes (a vector's lanes, the 64-token block), masks
include empty rows and columns, and the kernels are run split over several threads; csr_linear
runs every kernel variant (simulator.native.ALL_VARIANTS).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.csr import CSRStructure, _csr_arrays, csr_linear
from pathlib import Path

from simulator.native import (ALL_VARIANTS, POOLED_PER_SHAPE, BufferPool, KernelVariant,
                              build_kernels, load_kernels)

KERNELS = load_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the C kernels did not build")

# Sizes around the lanes of a vector (8 or 16 floats) and the 64-token block.
SIZES = st.one_of(st.integers(1, 40), st.sampled_from([15, 16, 17, 32, 48, 63, 64, 65, 80]))
TOKENS = st.one_of(st.integers(1, 140), st.sampled_from([63, 64, 65, 128, 129]))
DENSITIES = st.sampled_from([0.0, 0.03, 0.2, 0.6, 1.0])
DTYPES = st.sampled_from([torch.float32, torch.float64])


def random_mask(out_features, in_features, density, empty_rows, empty_cols, seed):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(out_features, in_features, generator=generator) < density
    mask[torch.randperm(out_features, generator=generator)[:empty_rows]] = False
    mask[:, torch.randperm(in_features, generator=generator)[:empty_cols]] = False
    return mask


def tolerance(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)


def _cpu_has_avx2() -> bool:
    try:
        return " avx2 " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


problems = st.fixed_dictionaries({
    "out_features": SIZES, "in_features": SIZES, "tokens": TOKENS, "density": DENSITIES,
    "empty_rows": st.integers(0, 5), "empty_cols": st.integers(0, 5),
    "dtype": DTYPES, "seed": st.integers(0, 2**16), "threads": st.integers(1, 5),
})


def build(p):
    mask = random_mask(p["out_features"], p["in_features"], p["density"], p["empty_rows"],
                       p["empty_cols"], p["seed"])
    generator = torch.Generator().manual_seed(p["seed"] + 1)
    weight = torch.randn(mask.shape, generator=generator, dtype=p["dtype"]) * mask
    x = torch.randn(p["tokens"], p["in_features"], generator=generator, dtype=p["dtype"])
    grad_y = torch.randn(p["tokens"], p["out_features"], generator=generator, dtype=p["dtype"])
    bias = torch.randn(p["out_features"], generator=generator, dtype=p["dtype"])
    return mask, weight, x, grad_y, bias


@settings(max_examples=60)
@given(problems)
def test_kernels_match_dense_products_for_any_thread_split(p):
    mask, weight, x, grad_y, bias = build(p)
    s = CSRStructure.from_mask(mask)
    threads, tokens = p["threads"], p["tokens"]
    vals = KERNELS.gather(weight, s.flat_index)
    packed_x = KERNELS.pack(x, threads=threads)
    packed_grad = KERNELS.pack(grad_y, threads=threads)
    y = KERNELS.spmm(s.indptr, s.cols, vals, bias, s.shape[1], packed_x, tokens, threads=threads)
    torch.testing.assert_close(y, x @ weight.t() + bias, **tolerance(p["dtype"]))
    vals_t = KERNELS.gather(vals, s.transpose_order)
    grad_x = KERNELS.spmm(s.indptr_t, s.cols_t, vals_t, None, s.shape[0], packed_grad, tokens,
                          threads=threads)
    torch.testing.assert_close(grad_x, grad_y @ weight, **tolerance(p["dtype"]))
    grad_w = KERNELS.sddmm(s.indptr, s.cols, s.shape[1], packed_grad, packed_x, dense=True,
                           threads=threads)
    torch.testing.assert_close(grad_w, (grad_y.t() @ x) * mask, **tolerance(p["dtype"]))
    assert not grad_w[~mask].any(), "the sampled weight gradient is exactly 0 off the mask"
    grad_values = KERNELS.sddmm(s.indptr, s.cols, s.shape[1], packed_grad, packed_x,
                                threads=threads)
    assert torch.equal(grad_values, grad_w.view(-1)[s.flat_index]), "the same sums, CSR order"


def fused_backward(kernels, s, vals, grad_y, x, threads, length=None, stream=True,
                   blocks_per_pass=1, prefetch=0):
    """dX, the weight gradient values and grad_y's column sums by the fused backward kernel."""
    return kernels.backward(s.indptr_t, s.cols_t, kernels.gather(vals, s.transpose_order),
                            s.transpose_order, grad_y, kernels.pack(x, threads=threads),
                            column_sums=True, length=length, blocks_per_pass=blocks_per_pass,
                            threads=threads, stream=stream, prefetch=prefetch)


@settings(max_examples=60)
@given(p=problems, padding=st.integers(0, 70), blocks_per_pass=st.sampled_from([1, 2]),
       prefetch=st.sampled_from([0, 8]))
def test_fused_backward_gives_the_dense_products_for_any_thread_split(p, padding,
                                                                     blocks_per_pass, prefetch):
    """dX = dY W and dW at the mask's non-zeros (CSR order, zero padded), from one pass over
    Wᵀ's CSR (one or two token blocks at a time); its values also fill the dense gradient (0
    off the mask)."""
    mask, weight, x, grad_y, _ = build(p)
    s = CSRStructure.from_mask(mask)
    vals = KERNELS.gather(weight, s.flat_index)
    grad_x, grad_values, sums = fused_backward(KERNELS, s, vals, grad_y, x, p["threads"],
                                               length=s.nnz + padding,
                                               blocks_per_pass=blocks_per_pass,
                                               prefetch=prefetch)
    torch.testing.assert_close(grad_x, grad_y @ weight, **tolerance(p["dtype"]))
    expected = (grad_y.t() @ x) * mask
    torch.testing.assert_close(grad_values[:s.nnz], expected.view(-1)[s.flat_index],
                               **tolerance(p["dtype"]))
    assert not grad_values[s.nnz:].any(), "the padding is 0"
    torch.testing.assert_close(sums, grad_y.sum(0), **tolerance(p["dtype"]))
    dense = KERNELS.dense_rows(s.indptr, s.cols, s.shape[1], grad_values, threads=p["threads"])
    assert torch.equal(dense.view(-1)[s.flat_index], grad_values[:s.nnz])
    assert not dense[~mask].any()


@settings(max_examples=30)
@given(p=problems, blocks_per_pass=st.sampled_from([1, 2]))
def test_fused_backward_is_bitwise_the_same_for_every_thread_split(p, blocks_per_pass):
    """Rows of Wᵀ split by non-zeros, features of dY (packed inside, with their sums) split
    evenly: each thread owns its dX columns, its weight gradient entries and its column sums,
    summed in the same order whoever computes them."""
    mask, weight, x, grad_y, _ = build(p)
    s = CSRStructure.from_mask(mask)
    vals = KERNELS.gather(weight, s.flat_index)
    outputs = [[t.clone() for t in fused_backward(KERNELS, s, vals, grad_y, x, threads,
                                                  blocks_per_pass=blocks_per_pass)]
               for threads in (1, 2, 3, 4)]
    for output in outputs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(output, outputs[0]))


@settings(max_examples=40)
@given(problems)
def test_spmm_is_bitwise_the_same_for_every_thread_split(p):
    """Splitting token blocks (threads dividing the blocks) or rows (otherwise) changes who
    computes an output, never the order of its sum."""
    mask, weight, x, _, bias = build(p)
    s = CSRStructure.from_mask(mask)
    vals = KERNELS.gather(weight, s.flat_index)
    packed_x = KERNELS.pack(x)
    outputs = [KERNELS.spmm(s.indptr, s.cols, vals, bias, s.shape[1], packed_x, p["tokens"],
                            threads=threads) for threads in (1, 2, 3, 4)]
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])


@settings(max_examples=40)
@given(p=problems, column_sums=st.booleans())
def test_pack_spmm_gives_the_bits_of_pack_then_spmm(p, column_sums):
    """Fused (threads dividing the token blocks: each packs its blocks as it reaches them) or
    not, one call gives what pack and spmm give one after the other, column sums included."""
    mask, weight, x, _, bias = build(p)
    s = CSRStructure.from_mask(mask)
    vals = KERNELS.gather(weight, s.flat_index)
    threads, tokens = p["threads"], p["tokens"]
    y, packed, sums = KERNELS.pack_spmm(x, s.indptr, s.cols, vals, bias,
                                        column_sums=column_sums, threads=threads)
    expected_packed, expected_sums = KERNELS.pack(x, threads=threads, column_sums=True)
    assert torch.equal(packed, expected_packed)
    assert torch.equal(y, KERNELS.spmm(s.indptr, s.cols, vals, bias, s.shape[1],
                                       expected_packed, tokens, threads=threads))
    assert torch.equal(sums, expected_sums) if column_sums else sums is None


@pytest.mark.parametrize("arch", [None, "-mavx2 -mfma", ""])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_spmm_output_large_enough_to_stream_has_the_bits_of_small_calls(arch, dtype, threads):
    """An output of 256 KiB or more is written with streaming stores (where aligned: 2 threads
    split the 18 token blocks, 4 split rows at any row; AVX-512, AVX2, or plain stores on the
    baseline build); it holds the same bits as the same products computed one 64-token block
    per call (plain stores), as the call told not to stream, and as the dense product; the
    fused backward's dX (streamed alike) the bits of its unstreamed call."""
    if arch == "-mavx2 -mfma" and not _cpu_has_avx2():
        pytest.skip("needs an x86 CPU with AVX2")
    kernels = KERNELS if arch is None else build_kernels(arch)
    tokens, out_features, in_features = 1100, 64, 40  # Y: 275 KiB in float32
    mask = random_mask(out_features, in_features, 0.3, 3, 3, seed=7)
    generator = torch.Generator().manual_seed(8)
    weight = torch.randn(mask.shape, generator=generator, dtype=dtype) * mask
    x = torch.randn(tokens, in_features, generator=generator, dtype=dtype)
    bias = torch.randn(out_features, generator=generator, dtype=dtype)
    s = CSRStructure.from_mask(mask)
    vals = kernels.gather(weight, s.flat_index)
    y, _, _ = kernels.pack_spmm(x, s.indptr, s.cols, vals, bias, threads=threads)
    block = kernels.block_tokens
    by_block = torch.cat([kernels.pack_spmm(x[start:start + block], s.indptr, s.cols, vals,
                                            bias)[0].clone()
                          for start in range(0, tokens, block)])
    assert torch.equal(y, by_block)
    assert torch.equal(y, kernels.pack_spmm(x, s.indptr, s.cols, vals, bias, threads=threads,
                                            stream=False)[0])
    torch.testing.assert_close(y, x @ weight.t() + bias, **tolerance(dtype))
    grad_y = torch.randn(tokens, out_features, generator=generator, dtype=dtype)
    streamed, stored = (fused_backward(kernels, s, vals, grad_y, x, threads,
                                       stream=stream)[0].clone() for stream in (True, False))
    assert torch.equal(streamed, stored)
    torch.testing.assert_close(streamed, grad_y @ weight, **tolerance(dtype))


@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=lambda v: v.name)
@settings(max_examples=6)
@given(p=problems)
def test_csr_linear_matches_masked_dense_autograd(variant, p):
    mask, weight, x, grad_y, bias = build(p)
    structure = CSRStructure.from_mask(mask)
    previous = torch.get_num_threads()
    torch.set_num_threads(min(p["threads"], 2))
    try:
        leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
        y = csr_linear(*leaves, structure, backend="native", variant=variant)
        y.backward(grad_y)
        ref = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
        y_ref = F.linear(ref[0], ref[1] * mask, ref[2])
        y_ref.backward(grad_y)
    finally:
        torch.set_num_threads(previous)
    tol = tolerance(p["dtype"])
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(leaves[0].grad, ref[0].grad, **tol)
    torch.testing.assert_close(leaves[1].grad, ref[1].grad, **tol)  # masked: 0 off the mask
    torch.testing.assert_close(leaves[2].grad, ref[2].grad, **tol)


@pytest.mark.skipif(not _cpu_has_avx2(), reason="needs an x86 CPU with AVX2")
@settings(max_examples=25)
@given(problems)
def test_avx2_and_baseline_builds_give_the_native_builds_results(p):
    """The AVX2-only build (8-lane vectors, its own lane sums), the baseline x86-64 build (no
    target flags: lane-by-lane sums), the -march=native build (16 lanes on AVX-512) and the
    256-bit variant of it agree, all with dense torch: the speed targets are checked on more
    than one build."""
    builds = [KERNELS, build_kernels("-mavx2 -mfma"), build_kernels(""),
              load_kernels(KernelVariant("256"))]
    assert all(builds) and len({kernels.path for kernels in builds}) == 4
    mask, weight, x, grad_y, bias = build(p)
    s = CSRStructure.from_mask(mask)
    results = []
    for kernels in builds:
        vals = kernels.gather(weight, s.flat_index)
        packed_x, packed_grad = kernels.pack(x), kernels.pack(grad_y)
        results.append([
            kernels.spmm(s.indptr, s.cols, vals, bias, s.shape[1], packed_x, p["tokens"],
                         threads=p["threads"]),
            kernels.spmm(s.indptr_t, s.cols_t, kernels.gather(vals, s.transpose_order), None,
                         s.shape[0], packed_grad, p["tokens"], threads=p["threads"]),
            kernels.sddmm(s.indptr, s.cols, s.shape[1], packed_grad, packed_x, dense=True,
                          threads=p["threads"])])
    expected = [x @ weight.t() + bias, grad_y @ weight, (grad_y.t() @ x) * mask]
    for native, *others, reference in zip(*results, expected):
        for other in others:
            torch.testing.assert_close(other, native, **tolerance(p["dtype"]))
            torch.testing.assert_close(other, reference, **tolerance(p["dtype"]))


@settings(max_examples=30)
@given(tokens=TOKENS, features=SIZES, threads=st.integers(1, 4), dtype=DTYPES)
def test_pack_is_the_zero_padded_token_blocked_layout_and_sums_columns(tokens, features, threads, dtype):
    x = torch.randn(tokens, features, dtype=dtype)
    block = KERNELS.block_tokens
    blocks = -(-tokens // block)
    padded = torch.zeros(blocks * block, features, dtype=dtype)
    padded[:tokens] = x
    expected = padded.view(blocks, block, features).transpose(1, 2)
    assert torch.equal(KERNELS.pack(x, threads=threads), expected)
    packed, sums = KERNELS.pack(x, threads=threads, column_sums=True)
    assert torch.equal(packed, expected)
    torch.testing.assert_close(sums, x.sum(0), **tolerance(dtype))


def test_pool_reuses_a_buffer_only_once_nothing_outside_refers_to_it():
    pool = BufferPool()
    first = pool.take((70, 24), torch.float32)
    address = first.data_ptr()
    view = first[3:]
    del first
    held = pool.take((70, 24), torch.float32)
    assert held.data_ptr() != address, "a view of the first buffer still refers to it"
    del view
    held.untyped_storage()  # a storage object made and dropped leaves the count as it was
    again = pool.take((70, 24), torch.float32)
    assert again.data_ptr() == address and again._base is None
    assert pool.take((24, 70), torch.float32).data_ptr() not in (address, held.data_ptr())
    kept = [pool.take((5,), torch.float64) for _ in range(POOLED_PER_SHAPE + 1)]
    del kept[-1]  # past the bound: a plain tensor, never handed out again
    assert pool.take((5,), torch.float64).data_ptr() not in {t.data_ptr() for t in kept}
    small = BufferPool(min_bytes=64)
    assert small.take((15,), torch.float32) is not small.take((16,), torch.float32)
    assert list(small._buffers) == [((16,), torch.float32)], "60 bytes: a plain tensor"


@pytest.mark.parametrize("as_values", [False, True], ids=["dense-weight", "values"])
def test_weight_gradient_is_adopted_without_a_copy_and_its_memory_reused(as_values):
    """Autograd takes the pooled gradient as .grad itself (no copy); once the optimizer sets
    .grad to None, the next backward writes into the same memory (no fresh pages)."""
    # sizes past POOLED_MIN_BYTES: values of 256 x 192 x 0.9 floats
    mask = torch.rand(256, 192, generator=torch.Generator().manual_seed(0)) < 0.9
    structure = CSRStructure.from_mask(mask)
    dense = torch.randn(256, 192) * mask
    weight = (KERNELS.gather(dense, structure.flat_index).clone() if as_values
              else dense).requires_grad_(True)
    x, upstream = torch.randn(70, 192), torch.randn(70, 256)
    addresses = []
    for _ in range(3):
        weight.grad = None
        csr_linear(x, weight, None, structure, backend="native").backward(upstream)
        addresses.append(weight.grad.data_ptr())
    pooled = {memory.data_ptr() for buffers in KERNELS.pool._buffers.values()
              for memory, _ in buffers}
    assert len(set(addresses)) == 1 and addresses[0] in pooled
    expected = (upstream.t() @ x) * mask
    torch.testing.assert_close(weight.grad, expected.view(-1)[structure.flat_index] if as_values
                               else expected, rtol=1e-5, atol=1e-5)


@given(n=st.integers(0, 500), seed=st.integers(0, 100))
@settings(max_examples=20)
def test_gather_equals_index_select(n, seed):
    generator = torch.Generator().manual_seed(seed)
    source = torch.randn(37, 11, generator=generator)
    index = torch.randint(0, source.numel(), (n,), generator=generator)
    assert torch.equal(KERNELS.gather(source, index), source.view(-1).index_select(0, index))


@settings(max_examples=40)
@given(out_features=st.integers(0, 70), in_features=st.integers(0, 70), density=DENSITIES,
       empty_rows=st.integers(0, 5), empty_cols=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_structure_built_in_c_equals_the_torch_build(out_features, in_features, density,
                                                    empty_rows, empty_cols, seed):
    mask = random_mask(out_features, in_features, density, empty_rows, empty_cols, seed)
    built = CSRStructure.from_mask(mask)
    for name, expected in _csr_arrays(mask).items():
        assert torch.equal(getattr(built, name).to(expected.dtype), expected), name
    # Both orientations describe the same mask.
    rebuilt = torch.zeros(in_features, out_features, dtype=torch.bool)
    rows_t = torch.repeat_interleave(torch.arange(in_features), built.indptr_t.diff().long())
    rebuilt[rows_t, built.cols_t.long()] = True
    assert torch.equal(rebuilt, mask.t())
