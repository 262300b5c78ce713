"""Hypothesis property tests for the mask invariants, over shapes, levels, algorithms, optimizers."""

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import sparsity

OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
}
DYNAMIC = ["set", "rigl", "granet", "gmp"]

shapes = st.tuples(st.integers(2, 24), st.integers(2, 24))
levels = st.floats(0.05, 0.95)


def build(shape, algorithm, level, optimizer, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(shape[1], shape[0]), nn.Tanh(), nn.Linear(shape[0], 3))
    kwargs = {"update": {"freq": 1, "stop": 1000}, "seed": seed}
    if algorithm == "granet":
        kwargs.update(init_sparsity=level / 2)
    if algorithm == "gmp":
        level_spec = {"type": "linear", "init": level / 2, "slope": 0.05}
    else:
        level_spec = level
    alg = sparsity.get_algorithm_class(algorithm)(sparsity=level_spec, **kwargs)
    model.apply(alg)
    opt = OPTIMIZERS[optimizer](model.parameters())
    alg.apply(opt)
    return model, alg, opt


def one_step(model, opt, shape, gen):
    opt.zero_grad()
    x = torch.randn(8, shape[1], generator=gen)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()


def state_tensors(opt, p):
    return [v for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.shape == p.shape]


@settings(max_examples=30)
@given(shape=shapes, algorithm=st.sampled_from(["set", "rigl"]), level=levels,
       optimizer=st.sampled_from(sorted(OPTIMIZERS)), seed=st.integers(0, 2**16))
def test_exact_nnz_and_zeros_everywhere_masked(shape, algorithm, level, optimizer, seed):
    model, alg, opt = build(shape, algorithm, level, optimizer, seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        old = {n: m.clone() for n, _, m in alg.sparse_parameters()}
        one_step(model, opt, shape, gen)
        for name, p, mask in alg.sparse_parameters():
            assert int(mask.sum()) == sparsity.keep_count(mask.numel(), level)
            assert (p[~mask] == 0).all()
            assert (p.grad[~mask] == 0).all()
            for value in state_tensors(opt, p):
                assert (value[~mask] == 0).all()
            grown = mask & ~old[name]
            assert (p[grown] == 0).all()  # grown weights start at zero ...
            for value in state_tensors(opt, p):
                assert (value[grown] == 0).all()  # ... with zero optimizer state


@settings(max_examples=20)
@given(shape=shapes, level=st.floats(0.3, 0.9), seed=st.integers(0, 2**16),
       optimizer=st.sampled_from(sorted(OPTIMIZERS)))
def test_gmp_never_regrows(shape, level, seed, optimizer):
    model, alg, opt = build(shape, "gmp", level, optimizer, seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(4):
        old = {n: m.clone() for n, _, m in alg.sparse_parameters()}
        one_step(model, opt, shape, gen)
        for name, _, mask in alg.sparse_parameters():
            assert not (mask & ~old[name]).any()


@settings(max_examples=20)
@given(shape=shapes, level=st.floats(0.3, 0.95), seed=st.integers(0, 2**16),
       pruning=st.sampled_from(["global", "layer"]))
def test_granet_reaches_scheduled_target_at_every_update(shape, level, seed, pruning):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(shape[1], shape[0]), nn.Tanh(), nn.Linear(shape[0], 3))
    alg = sparsity.GraNet(sparsity=level, init_sparsity=0.0, update={"freq": 1, "stop": 5},
                          pruning=pruning, seed=seed)
    model.apply(alg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    alg.apply(opt)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(4):
        one_step(model, opt, shape, gen)
        target = alg.target_sparsity(alg.step)
        kept = sum(int(m.sum()) for _, _, m in alg.sparse_parameters())
        total = sum(m.numel() for _, _, m in alg.sparse_parameters())
        budget = sum(sparsity.keep_count(m.numel(), target) for _, _, m in alg.sparse_parameters())
        assert kept == budget, (alg.step, kept, budget, total)


@settings(max_examples=15)
@given(shape=shapes, algorithm=st.sampled_from(DYNAMIC), level=levels, seed=st.integers(0, 2**16))
def test_same_seed_gives_bit_identical_masks_and_losses(shape, algorithm, level, seed):
    runs = []
    for _ in range(2):
        model, alg, opt = build(shape, algorithm, level, "adamw", seed)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(3):
            one_step(model, opt, shape, gen)
        runs.append(({n: m.clone() for n, _, m in alg.sparse_parameters()}, model.state_dict()))
    (masks_a, sd_a), (masks_b, sd_b) = runs
    assert all(torch.equal(masks_a[k], masks_b[k]) for k in masks_a)
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)


@settings(max_examples=50)
@given(shape=shapes, seed=st.integers(0, 2**16), spread=st.floats(0.0, 4.0))
@example(shape=(8, 8), seed=8, spread=4.0)  # 11 decades: 200 iterations left rows 0.4% apart
def test_sinkhorn_scaled_equalises_lines_and_keeps_cross_ratios(shape, seed, spread):
    """Equal row sums and equal column sums; only per-row and per-column factors applied, so
    every cross-ratio s_ij s_kl / (s_il s_kj), which is what RigL's choice still reads, stays.

    Sinkhorn converges geometrically, at a rate that nears 1 as the score's dynamic range grows
    (spread 4 spans up to e^±16), hence the many iterations here."""
    gen = torch.Generator().manual_seed(seed)
    score = torch.exp(spread * torch.randn(shape, generator=gen, dtype=torch.float64))
    scaled = sparsity.masks.sinkhorn_scaled(score, iterations=5000)
    rows, cols = scaled.sum(1), scaled.sum(0)
    torch.testing.assert_close(rows, rows.mean().expand_as(rows), rtol=1e-3, atol=0)
    torch.testing.assert_close(cols, cols.mean().expand_as(cols), rtol=1e-3, atol=0)
    ratio = lambda s: s[0, 0] * s[1:, 1:] / (s[0, 1:] * s[1:, :1])  # noqa: E731
    torch.testing.assert_close(ratio(scaled), ratio(score), rtol=1e-9, atol=0)


@settings(max_examples=20)
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_sinkhorn_scaled_outer_product_is_uniform_and_nan_stays_nan(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    rank1 = (torch.rand(shape[0], 1, generator=gen) + 0.01) * (torch.rand(1, shape[1], generator=gen) + 0.01)
    scaled = sparsity.masks.sinkhorn_scaled(rank1)
    torch.testing.assert_close(scaled, scaled.mean().expand_as(scaled), rtol=1e-4, atol=0)
    rank1[0, 0] = float("nan")
    assert sparsity.masks.sinkhorn_scaled(rank1).isnan().nonzero().tolist() == [[0, 0]]
