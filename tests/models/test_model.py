"""The decoder: both families from ModelZoo keys, ModelZoo parameter names, RoPE, determinism,
causality, Sparse-Wide, meta-device builds."""

import fnmatch
from dataclasses import replace
from typing import get_args

import pytest
import torch

from models.config import ModelConfig, preset_config
from models.positions import apply_rope, rope_tables
from models import transformer
from models.transformer import build_model
from csx_config import PRESETS, PresetName

torch.set_num_threads(1)
TINY = preset_config("tiny")
GPT2_SMALL = ModelConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_heads=4, filter_size=64,
                         max_position_embeddings=16, position_embedding_type="learned", nonlinearity="gelu",
                         norm_type="layernorm", use_projection_bias_in_attention=True,
                         use_ffn_bias_in_attention=True, use_ffn_bias=True)


def test_presets_grow_and_count_parameters_exactly():
    assert set(PRESETS) == set(get_args(PresetName))
    counts = [build_model(preset_config(name), seed=0).num_parameters() for name in ("tiny", "mini", "small")]
    assert counts == sorted(counts)
    c = TINY
    per_layer = 4 * c.hidden_size**2 + 3 * c.hidden_size * c.filter_size + 2 * c.hidden_size  # + 2 RMSNorms
    expected = c.vocab_size * c.hidden_size + c.num_hidden_layers * per_layer + c.hidden_size  # tied head
    assert build_model(TINY, seed=0).num_parameters() == expected
    untied = build_model(replace(c, share_embedding_weights=False), seed=0)
    assert untied.num_parameters() == expected + c.vocab_size * c.hidden_size


def _modelzoo_names(layers: int, glu: bool, biases: bool, learned: bool, tied: bool, norm_bias: bool) -> set[str]:
    """The parameter names ModelZoo's GPT2LMHeadModel has for these options (written out here,
    independently of the model code)."""
    names = {"embedding_layer.word_embeddings.weight", "transformer_decoder.norm.weight"}
    names |= {"embedding_layer.position_embeddings.weight"} if learned else set()
    names |= {"transformer_decoder.norm.bias"} if norm_bias else set()
    names |= set() if tied else {"lm_head.weight"}
    for i in range(layers):
        prefix = f"transformer_decoder.layers.{i}"
        linears = [f"self_attn.proj_{x}_dense_layer" for x in ("q", "k", "v", "output")]
        linears += ["ffn.ffn.0.linear_layer", "ffn.ffn.1.linear_layer"]
        linears += ["ffn.ffn.0.linear_layer_for_glu"] if glu else []
        names |= {f"{prefix}.{lin}.weight" for lin in linears}
        names |= {f"{prefix}.{lin}.bias" for lin in linears} if biases else set()
        names |= {f"{prefix}.{n}.{w}" for n in ("norm1", "norm3") for w in (("weight", "bias") if norm_bias else ("weight",))}
    return names


def test_parameter_names_are_modelzoos():
    llama = {n for n, _ in build_model(TINY, seed=0).named_parameters()}
    assert llama == _modelzoo_names(2, glu=True, biases=False, learned=False, tied=True, norm_bias=False)
    gpt = {n for n, _ in build_model(replace(GPT2_SMALL, share_embedding_weights=False), seed=0).named_parameters()}
    assert gpt == _modelzoo_names(2, glu=False, biases=True, learned=True, tied=False, norm_bias=True)


def test_modelzoo_filters_select_what_they_select_in_modelzoo():
    from sparsity import configure

    model = build_model(TINY, seed=0)
    globs = ["*proj_[qkv]_dense_layer.weight", "*proj_output_dense_layer.weight", "*linear_layer.weight"]
    alg = configure({"algorithm": "static", "sparsity": 0.5, "param_filter": globs})
    alg.apply(model)
    expected = {n for n, p in model.named_parameters() if any(fnmatch.fnmatchcase(n, g) for g in globs)}
    assert {n for n, _, _ in alg.sparse_parameters()} == expected
    assert len(expected) == 2 * 6  # ModelZoo's "*linear_layer.weight" leaves the GLU gate dense
    default = configure({"algorithm": "static", "sparsity": 0.5})
    default.apply(build_model(TINY, seed=0))
    assert len(default.sparse_parameters()) == 2 * 7  # embeddings, norms, lm_head stay dense


def test_forward_shapes_and_loss_near_uniform_at_init():
    for config in (TINY, GPT2_SMALL):
        model = build_model(config, seed=0)
        tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        logits, loss = model(tokens, tokens.roll(1, dims=1))
        assert logits.shape == (2, 16, config.vocab_size)
        assert abs(loss.item() - torch.log(torch.tensor(float(config.vocab_size))).item()) < 0.3


def test_padding_targets_are_ignored():
    model = build_model(GPT2_SMALL, seed=0)
    tokens = torch.randint(0, 300, (1, 8))
    targets = tokens.roll(1, dims=1)
    padded = targets.clone()
    padded[0, 5:] = -100
    _, full = model(tokens[:, :5], targets[:, :5])
    _, masked = model(tokens, padded)
    assert torch.allclose(full, masked, atol=1e-6)


def test_same_seed_same_weights_different_seed_different():
    a, b, c = (build_model(TINY, seed=s).state_dict() for s in (1, 1, 2))
    key = "transformer_decoder.layers.0.self_attn.proj_q_dense_layer.weight"
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[key], c[key])


def test_modelzoo_initializers_are_applied():
    init = {"name": "truncated_normal", "mean": 0.0, "std": 0.02, "a": -0.04, "b": 0.04}
    config = replace(GPT2_SMALL, initializer=init, output_layer_initializer={"name": "zeros"})
    model = build_model(config, seed=0)
    q = model.transformer_decoder.layers[0].self_attn.proj_q_dense_layer.weight
    assert q.abs().max() <= 0.04 and q.std() > 0.01
    assert model.transformer_decoder.layers[0].ffn.ffn[1].linear_layer.weight.abs().max() == 0
    assert model.transformer_decoder.layers[0].self_attn.proj_q_dense_layer.bias.abs().max() == 0


def test_causal_future_tokens_do_not_change_past_logits():
    model = build_model(TINY, seed=0)
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
    partial = apply_rope(q.expand(1, 1, 32, 8).contiguous(), *rope_tables(4, 32, 10000.0))[0, 0]
    assert torch.equal(partial[:, 4:], q[4:].expand(32, 4))  # rotary_dim 4: the rest passes through


def test_sparse_wide_widens_blocks_to_iso_nonzeros():
    wide = build_model(replace(TINY, sparse_wide_sparsity=0.75), seed=0)
    assert wide.built.hidden_size == 2 * TINY.hidden_size and wide.built.filter_size == 2 * TINY.filter_size
    assert wide.built.num_heads == TINY.num_heads
    q = wide.transformer_decoder.layers[0].self_attn.proj_q_dense_layer.weight
    assert q.numel() * (1 - 0.75) == TINY.hidden_size**2  # the sparse layer keeps the dense FLOPs
    assert wide.embedding_layer.word_embeddings.weight.shape == (256, 2 * TINY.hidden_size)


def test_meta_build_allocates_nothing_for_a_7b_model():
    llama2_7b = ModelConfig(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_heads=32,
                            filter_size=11008, max_position_embeddings=4096, share_embedding_weights=False)
    model = build_model(llama2_7b, seed=0, device="meta")
    assert model.num_parameters() == 6_738_415_616  # Llama-2 7B
    assert all(p.device.type == "meta" for p in model.parameters())


def test_a_meta_build_skips_only_the_fills_of_meta_tensors_and_only_in_its_thread():
    """The meta build skips torch's initial fills (half its time); the shapes are a real
    model's, and a model built meanwhile in another thread is drawn as always."""
    import threading

    real = build_model(TINY, seed=3)
    drawn_meanwhile: list[torch.nn.Module] = []
    started, release = threading.Event(), threading.Event()

    def build_in_another_thread() -> None:
        started.wait(10)
        drawn_meanwhile.append(build_model(TINY, seed=3))
        release.set()

    thread = threading.Thread(target=build_in_another_thread)
    thread.start()
    with torch.device("meta"), transformer._ShapesOnly():  # the meta build's context, held
        started.set()
        assert release.wait(60)
        meta = transformer.Transformer(TINY)
    thread.join()
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [(n, p.shape) for n, p in real.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(real.state_dict().values(), drawn_meanwhile[0].state_dict().values()))


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig(hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="rotary_dim"):
        ModelConfig(rotary_dim=3)
    with pytest.raises(ValueError, match="nonlinearity"):
        ModelConfig(nonlinearity="swishy")
    with pytest.raises(ValueError, match="sparse_wide_sparsity"):
        ModelConfig(sparse_wide_sparsity=1.0)
    with pytest.raises(ValueError, match="tiny"):
        preset_config("huge")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        build_model(TINY, 0)(torch.zeros(1, 200, dtype=torch.long))
