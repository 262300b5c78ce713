"""The decoder: sizes per preset, names the sparsity globs target, RoPE and causality."""

from dataclasses import replace

import pytest
import torch

from workers.model import PRESETS, ModelConfig, apply_rope, build_model, preset_config, rope_tables
from workers.spec import PresetName
from typing import get_args


def test_presets_match_spec_names_and_sizes():
    assert set(PRESETS) == set(get_args(PresetName))
    counts = {name: build_model(config, seed=0).num_parameters() for name, config in PRESETS.items()}
    assert counts["tiny"] < 1_000_000
    assert 5_000_000 <= counts["small"] <= 10_000_000
    assert counts["tiny"] < counts["mini"] < counts["small"]


def test_tiny_parameter_count_by_formula():
    c = PRESETS["tiny"]
    per_layer = 4 * c.d_model**2 + 3 * c.d_model * c.d_ff + 2 * c.d_model
    expected = c.vocab_size * c.d_model + c.n_layer * per_layer + c.d_model  # tied head
    assert build_model(c, seed=0).num_parameters() == expected
    untied = build_model(replace(c, tie_embeddings=False), seed=0)
    assert untied.num_parameters() == expected + c.vocab_size * c.d_model


def test_parameter_names_for_globs():
    names = {n for n, _ in build_model(PRESETS["tiny"], seed=0).named_parameters()}
    for proj in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "attn_norm", "mlp_norm"):
        assert f"layers.1.{proj}.weight" in names
    assert {"embedding.weight", "norm.weight"} <= names
    assert "lm_head.weight" in {n for n, _ in build_model(replace(PRESETS["tiny"], tie_embeddings=False), 0).named_parameters()}


def test_forward_shapes_and_loss_near_uniform_at_init():
    model = build_model(PRESETS["tiny"], seed=0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    logits, loss = model(tokens, tokens.roll(1, dims=1))
    assert logits.shape == (2, 16, 256)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.3


def test_same_seed_same_weights_different_seed_different():
    a, b, c = (build_model(PRESETS["tiny"], seed=s).state_dict() for s in (1, 1, 2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.q_proj.weight"], c["layers.0.attn.q_proj.weight"])


def test_causal_future_tokens_do_not_change_past_logits():
    model = build_model(PRESETS["tiny"], seed=0)
    tokens = torch.randint(0, 256, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    with torch.no_grad():
        before, _ = model(tokens)
        after, _ = model(changed)
    assert torch.allclose(before[0, :8], after[0, :8], atol=1e-6)
    assert not torch.allclose(before[0, 8:], after[0, 8:])


def test_rope_preserves_norm_and_gives_relative_scores():
    cos, sin = rope_tables(8, 32, 10000.0)
    q, k = torch.randn(8), torch.randn(8)
    rotated = apply_rope(q.expand(1, 1, 32, 8).contiguous(), cos, sin)[0, 0]
    assert torch.allclose(rotated.norm(dim=-1), q.norm().expand(32), atol=1e-5)
    keys = apply_rope(k.expand(1, 1, 32, 8).contiguous(), cos, sin)[0, 0]
    # q at position m against k at n depends only on m - n
    assert torch.allclose(rotated[5] @ keys[3], rotated[12] @ keys[10], atol=1e-5)
    assert torch.equal(rotated[0], q)  # position 0 is not rotated


def test_sparse_wide_widens_blocks_to_iso_nonzeros():
    base = PRESETS["tiny"]
    wide = build_model(replace(base, sparse_wide_sparsity=0.75), seed=0)
    assert wide.built.d_model == 2 * base.d_model and wide.built.d_ff == 2 * base.d_ff
    assert wide.built.n_head == base.n_head
    q = wide.layers[0].attn.q_proj.weight
    assert q.numel() * (1 - 0.75) == base.d_model**2  # the sparse layer keeps the dense FLOPs
    assert wide.embedding.weight.shape == (256, 2 * base.d_model)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="d_model"):
        ModelConfig(d_model=30, n_head=4)
    with pytest.raises(ValueError, match="sparse_wide_sparsity"):
        ModelConfig(sparse_wide_sparsity=1.0)
    with pytest.raises(ValueError, match="tiny"):
        preset_config("huge")
    with pytest.raises(ValueError, match="max_seq_len"):
        build_model(PRESETS["tiny"], 0)(torch.zeros(1, 200, dtype=torch.long))
