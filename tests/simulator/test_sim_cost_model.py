"""Weight-streaming cost model: worked values and properties."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from torch import nn

from simulator.cost_model import (CS2, CostKnobs, LayerShape, WaferScaleCluster,
                                  gpt_layer_shapes, layers_from_model, project_layer,
                                  project_step)

GPT3_125M = dict(n_layer=12, d_model=768, d_ff=3072, vocab_size=50257, seq_len=2048)
TOKENS_125M = 256 * 2048


def test_cs2_peak_is_the_public_number():
    assert CS2().peak_flop_per_s == pytest.approx(7.48e15)
    assert dataclasses.is_dataclass(CS2) and CS2.__dataclass_params__.frozen


def test_single_layer_matches_the_formula_by_hand():
    layer = LayerShape("fc", 1000, 500, density=0.2)
    cluster = WaferScaleCluster(2)
    got = project_layer(layer, tokens=10_000, cluster=cluster)
    knobs = cluster.knobs
    compute_s = (6 * 500_000 * (0.2 + 0.1 * 0.8) * 5_000 / (0.5 * 7.48e15)) + 20e-6
    io_s = (2 * min(2 * 500_000, 4 * 100_000) + 2 * 100_000) / 150e9
    assert got.compute_ms == pytest.approx(compute_s * 1e3)
    assert got.io_ms == pytest.approx(io_s * 1e3)
    assert got.bound == ("compute" if compute_s > io_s else "io")
    step = project_step([layer], 10_000, cluster)
    expected = max(compute_s, io_s) + knobs.bubble_s + knobs.swarmx_hop_s * 1 + knobs.sync_s
    assert step.step_ms == pytest.approx(expected * 1e3)


def test_a_routed_expert_computes_on_its_share_of_the_tokens_and_streams_all_its_weights():
    expert = LayerShape("experts.0.fc", 1000, 500, density=0.2, token_share=0.25)  # top 2 of 8
    got = project_layer(expert, tokens=10_000, cluster=WaferScaleCluster(2))
    compute_s = (6 * 500_000 * (0.2 + 0.1 * 0.8) * 0.25 * 5_000 / (0.5 * 7.48e15)) + 20e-6
    io_s = (2 * min(2 * 500_000, 4 * 100_000) + 2 * 100_000) / 150e9  # as if every token came
    assert got.compute_ms == pytest.approx(compute_s * 1e3)
    assert got.io_ms == pytest.approx(io_s * 1e3)
    step = project_step([expert], 10_000, WaferScaleCluster(2))
    assert step.useful_flops == pytest.approx(6 * 500_000 * 0.2 * 0.25 * 10_000)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    layers = layers_from_model(model, token_share=lambda name: 0.5 if name == "0" else 1.0)
    assert [layer.token_share for layer in layers] == [0.5, 1.0]


def test_dense_model_speedup_is_exactly_one():
    layers = gpt_layer_shapes(**GPT3_125M, density=1.0)
    for n in (1, 3, 16):
        assert project_step(layers, TOKENS_125M, WaferScaleCluster(n)).speedup_vs_dense == 1.0


@pytest.mark.parametrize("tokens", [2048, TOKENS_125M], ids=["io-bound", "compute-bound"])
def test_step_time_is_monotone_in_density(tokens):
    times = [project_step(gpt_layer_shapes(**GPT3_125M, density=d), tokens,
                          WaferScaleCluster(1)).step_ms for d in (0.01, 0.1, 0.25, 0.5, 1.0)]
    assert times == sorted(times)
    assert times[0] < times[-1]


def test_scaling_efficiency_at_most_one_and_non_increasing():
    layers = gpt_layer_shapes(**GPT3_125M, density=0.25)
    eff = [project_step(layers, TOKENS_125M, WaferScaleCluster(n)).scaling_efficiency
           for n in (1, 2, 3, 4, 8, 16, 64, 192)]
    assert eff[0] == 1.0
    assert all(e <= 1.0 for e in eff)
    assert all(b <= a for a, b in zip(eff, eff[1:]))
    assert eff[-1] < 0.5  # I/O-bound far out: weights are broadcast, not split


def test_gpt3_125m_at_75_percent_projects_published_range():
    proj = project_step(gpt_layer_shapes(**GPT3_125M, density=0.25), TOKENS_125M,
                        WaferScaleCluster(1))
    assert 1.4 <= proj.speedup_vs_dense <= 2.0
    by_name = {layer.name: layer for layer in proj.per_layer}
    assert by_name["lm_head"].density == 1.0 and by_name["h.0.mlp.fc1"].density == 0.25
    assert 0 < proj.tflops < CS2().peak_flop_per_s / 1e12


def test_dense_gradient_steps_cost_more_io():
    layer = LayerShape("fc", 4096, 4096, density=0.1)
    plain = project_layer(layer, 64, WaferScaleCluster(1))
    update = project_layer(layer, 64, WaferScaleCluster(1), dense_grad=True)
    assert update.io_ms > plain.io_ms and update.bound == plain.bound == "io"


def test_equal_density_masks_can_project_different_times():
    rows, cols = 3072, 768
    gen = torch.Generator().manual_seed(0)
    spread = torch.rand(rows, cols, generator=gen) < 0.1
    piled = torch.zeros(rows, cols, dtype=torch.bool)
    piled.view(-1)[: int(spread.sum())] = True   # same count, all in the first rows
    cluster = WaferScaleCluster(1)
    a = project_step([LayerShape.from_mask("a", spread)], TOKENS_125M, cluster)
    b = project_step([LayerShape.from_mask("a", piled)], TOKENS_125M, cluster)
    assert a.per_layer[0].density == b.per_layer[0].density
    assert b.per_layer[0].imbalance > 4 * a.per_layer[0].imbalance  # bounded by 1/(d+κ(1-d))
    assert b.step_ms > a.step_ms


def test_swarmx_levels_are_ceil_log4():
    levels = {n: WaferScaleCluster(n).swarmx_levels for n in (1, 2, 4, 5, 16, 17, 64, 192)}
    assert levels == {1: 0, 2: 1, 4: 1, 5: 2, 16: 2, 17: 3, 64: 3, 192: 4}


def test_layers_from_model_reads_live_masks():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24)

    model = nn.Sequential(Attention(), nn.Linear(8, 16), nn.Linear(16, 4))
    mask = torch.zeros(16, 8, dtype=torch.bool)
    mask[:, :2] = True
    model[1].register_buffer("weight_mask", mask)
    layers = layers_from_model(model, seq_tokens=32)
    names = [layer.name for layer in layers]
    assert names == ["0.scores", "0.qkv.weight", "1.weight", "2.weight"]
    assert layers[0].out_features == 64 and not layers[0].streams_weights
    assert layers[2].density == 0.25 and layers[2].row_nnz == (2,) * 16
    before = project_step(layers, 4096, WaferScaleCluster(1)).step_ms
    mask.copy_(torch.ones_like(mask))            # an in-place mask update
    after_layers = layers_from_model(model, seq_tokens=32)
    assert after_layers[2].density == 1.0 and after_layers[2].row_nnz is None
    assert project_step(after_layers, 4096, WaferScaleCluster(1)).step_ms > before


def test_attention_scores_cost_the_heads_width_and_the_keys_attended():
    class Attention(nn.Module):
        def __init__(self, window=None, sink_tokens=None):
            super().__init__()
            self.num_heads, self.head_dim = 4, 6  # 24 wide, on a 32-wide stream
            self.window, self.sink_tokens = window, sink_tokens
            self.proj_q = nn.Linear(32, 24)

    def scores(module: nn.Module) -> tuple[int, int]:
        layer = layers_from_model(module, seq_tokens=100)[0]
        return layer.out_features, layer.in_features

    assert scores(Attention()) == (2 * 100, 24)
    assert scores(Attention(window=16)) == (2 * 16, 24)
    assert scores(Attention(window=16, sink_tokens=4)) == (2 * 20, 24)
    assert scores(Attention(window=128, sink_tokens=4)) == (2 * 100, 24)  # never more than the sequence


def test_bad_values_are_rejected_by_name():
    with pytest.raises(ValueError, match="num_csx"):
        WaferScaleCluster(193)
    with pytest.raises(TypeError, match="num_csx"):
        WaferScaleCluster(2.0)
    with pytest.raises(ValueError, match="efficiency"):
        CostKnobs(efficiency=0.0)
    with pytest.raises(ValueError, match="density"):
        LayerShape("x", 4, 4, density=1.5)
    with pytest.raises(ValueError, match="token_share"):
        LayerShape("x", 4, 4, token_share=0.0)
    with pytest.raises(ValueError, match="row_nnz"):
        LayerShape("x", 2, 4, density=0.5, row_nnz=(4, 4))
    with pytest.raises(ValueError, match="tokens"):
        project_step([LayerShape("x", 4, 4)], 0, WaferScaleCluster(1))
    with pytest.raises(ValueError, match="layers"):
        project_step([], 8, WaferScaleCluster(1))


@given(st.lists(st.tuples(st.sampled_from([(64, 32), (32, 64), (64, 64)]),
                          st.sampled_from([1.0, 0.5, 0.1]), st.sampled_from([1.0, 0.25]),
                          st.booleans(), st.booleans()), min_size=1, max_size=12),
       st.integers(1, 4), st.booleans())
@settings(max_examples=60)
def test_a_step_projects_each_layer_as_if_alone(specs, num_csx, dense_grad):
    """project_step projects alike layers once (a deep model's repeated blocks); every layer
    still gets the projection it would get alone, under its own name, live masks included."""
    layers = []
    for i, ((rows, cols), density, share, scores, live) in enumerate(specs):
        if scores:
            layers.append(LayerShape(f"l{i}.scores", rows, cols, streams_weights=False,
                                     token_share=share))
        elif live:
            mask = torch.rand(rows, cols, generator=torch.Generator().manual_seed(i)) < density
            layers.append(LayerShape.from_mask(f"l{i}", mask, token_share=share))
        else:
            layers.append(LayerShape(f"l{i}", rows, cols, density, token_share=share))
    cluster = WaferScaleCluster(num_csx)
    step = project_step(layers, tokens=512, cluster=cluster, dense_grad=dense_grad)
    assert step.per_layer == tuple(project_layer(layer, 512, cluster, dense_grad)
                                   for layer in layers)
    alone = [project_layer(layer.as_dense(), 512, cluster) for layer in layers]
    overhead = step.overhead_ms
    assert step.dense_step_ms == pytest.approx(sum(p.time_ms for p in alone) + overhead)
