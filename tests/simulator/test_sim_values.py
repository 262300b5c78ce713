"""Weights as values: csr_linear over W's non-zeros in CSR order, with the weight gradient in
the same order (no dense gradient), against masked dense layers and masked dense training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.csr import CSRStructure, csr_linear, dense_weight, weight_values
from simulator.native import ALL_VARIANTS, DEFAULT_VARIANT, load_kernels

BACKENDS = ["torch"] + (["native"] if load_kernels() is not None else [])
# the torch backend has no variants; the native one runs each
BACKEND_VARIANTS = [("torch", DEFAULT_VARIANT)] + [("native", v) for v in ALL_VARIANTS
                                                   if "native" in BACKENDS]


@pytest.mark.parametrize(("backend", "variant"), BACKEND_VARIANTS,
                         ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("density", [0.0, 0.15, 1.0])
def test_values_gradient_is_the_masked_dense_gradient_in_csr_order(backend, variant, density):
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(40, 70, generator=generator) < density
    weight = torch.randn(40, 70, generator=generator) * mask
    bias, x = torch.randn(40, generator=generator), torch.randn(2, 67, 70, generator=generator)
    structure = CSRStructure.from_mask(mask)
    values = weight_values(None, structure, weight).requires_grad_(True)
    leaves = [t.clone().requires_grad_(True) for t in (x, bias)]
    y = csr_linear(leaves[0], values, leaves[1], structure, backend=backend, variant=variant)
    upstream = torch.randn_like(y)
    y.backward(upstream)
    ref = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    y_ref = F.linear(ref[0], ref[1] * mask, ref[2])
    y_ref.backward(upstream)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(leaves[0].grad, ref[0].grad, **tol)
    torch.testing.assert_close(leaves[1].grad, ref[2].grad, **tol)
    assert values.grad.shape == (structure.nnz,)
    torch.testing.assert_close(values.grad, ref[1].grad.view(-1)[structure.flat_index], **tol)


def test_dense_weight_inverts_weight_values():
    mask = torch.tensor([[True, False, True], [False, False, False], [False, True, True]])
    structure = CSRStructure.from_mask(mask)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    dense = dense_weight(structure, values)
    assert dense.tolist() == [[1.0, 0.0, 2.0], [0.0, 0.0, 0.0], [0.0, 3.0, 4.0]]
    assert torch.equal(weight_values(load_kernels(), structure, dense), values)


def test_values_of_the_wrong_length_or_with_dense_grad_are_rejected_by_name():
    mask = torch.rand(4, 6, generator=torch.Generator().manual_seed(0)) < 0.5
    structure = CSRStructure.from_mask(mask)
    x = torch.randn(3, 6)
    with pytest.raises(ValueError, match="weight values"):
        csr_linear(x, torch.zeros(structure.nnz + 1), None, structure)
    with pytest.raises(ValueError, match="dense_grad"):
        csr_linear(x, torch.zeros(structure.nnz), None, structure, dense_grad=True)


def _rigl_mask(mask, weight, dense_grad, count):
    """A RigL update: drop the `count` kept weights of least magnitude, grow the `count`
    dropped-or-inactive positions of largest gradient magnitude (ties by position)."""
    flat_mask, score = mask.reshape(-1), weight.abs().reshape(-1)
    kept = flat_mask.nonzero().squeeze(1)
    drop = kept[torch.sort(score[kept], stable=True).indices[:count]]
    new_mask = flat_mask.clone()
    new_mask[drop] = False
    inactive = (~new_mask).nonzero().squeeze(1)
    grow_score = dense_grad.abs().reshape(-1)[inactive]
    grow = inactive[torch.sort(-grow_score, stable=True).indices[:count]]
    new_mask[grow] = True
    return new_mask.view_as(mask)


@settings(max_examples=12)
@given(out_features=st.integers(1, 96), in_features=st.integers(1, 96),
       tokens=st.integers(1, 200), density=st.floats(0.05, 0.5), threads=st.integers(1, 2),
       steps=st.integers(2, 5), seed=st.integers(0, 2**16))
def test_values_as_weights_training_equals_masked_dense_training(
        out_features, in_features, tokens, density, threads, steps, seed):
    """SGD with momentum on the values (ordinary steps: no dense gradient) against SGD on the
    dense masked weight, through a RigL update step halfway: that step runs the values' layer
    on the dense weight with dense_grad=True, both sides take the masked dense run's new mask,
    and the values and momentum move to the new structure (0 where grown)."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(out_features, in_features, generator=generator) < density
    weight = torch.randn(out_features, in_features, generator=generator) * mask
    data = [(torch.randn(tokens, in_features, generator=generator),
             torch.randn(tokens, out_features, generator=generator)) for _ in range(steps)]
    lr, momentum, update_step = 0.05, 0.9, steps // 2
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        structure = CSRStructure.from_mask(mask)
        values, values_buf = weight_values(None, structure, weight), None
        dense, dense_buf = weight.clone(), None
        for step, (x, target) in enumerate(data):
            dense_leaf = dense.clone().requires_grad_(True)
            masked = dense_leaf * mask
            masked.retain_grad()
            loss_ref = F.mse_loss(F.linear(x, masked), target)
            loss_ref.backward()
            dense_grad_ref = masked.grad  # dYᵀX everywhere: what RigL grows from
            if step == update_step:
                leaf = dense_weight(structure, values).requires_grad_(True)
                loss = F.mse_loss(csr_linear(x, leaf, None, structure, dense_grad=True), target)
                loss.backward()
                torch.testing.assert_close(leaf.grad, dense_grad_ref, rtol=1e-4, atol=1e-6)
                grad = weight_values(None, structure, leaf.grad)
            else:
                leaf = values.clone().requires_grad_(True)
                loss = F.mse_loss(csr_linear(x, leaf, None, structure), target)
                loss.backward()
                grad = leaf.grad
            torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-6)
            values_buf = grad if values_buf is None else momentum * values_buf + grad
            values = values - lr * values_buf
            grad_ref = dense_leaf.grad
            dense_buf = grad_ref if dense_buf is None else momentum * dense_buf + grad_ref
            dense = dense - lr * dense_buf
            if step == update_step:
                count = max(1, structure.nnz // 4) if structure.nnz else 0
                new_mask = _rigl_mask(mask, dense, dense_grad_ref, count)
                new_structure = CSRStructure.from_mask(new_mask)
                values = weight_values(None, new_structure, dense_weight(structure, values))
                values_buf = weight_values(None, new_structure,
                                           dense_weight(structure, values_buf))
                dense, dense_buf = dense * new_mask, dense_buf * new_mask
                mask, structure = new_mask, new_structure
        torch.testing.assert_close(dense_weight(structure, values), dense, rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(previous)
