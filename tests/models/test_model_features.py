"""The model features ModelZoo's decoder families need, each on a tiny proxy against an
independent reference: grouped-query attention, sliding windows, ALiBi, RoPE scaling, muP,
biases and tied embeddings; parameter counts against the published sizes (meta device); plans
at a schedule's target; GQA-shaped projections on the simulated fabric."""

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from training.plan import model_config, plan_job
from models.config import ModelConfig
from models.initializers import initializers
from models.positions import alibi_slopes, rope_frequencies, rope_tables, visible_keys
from models.transformer import build_model
from training.report import plan_report, plan_table
from csx_config import JobSpec

torch.set_num_threads(1)
LLAMA = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, filter_size=48,
                    max_position_embeddings=32)
GPT = replace(LLAMA, position_embedding_type="learned", nonlinearity="gelu", norm_type="layernorm",
              use_projection_bias_in_attention=True, use_ffn_bias_in_attention=True, use_ffn_bias=True)


def gqa(config: ModelConfig, groups: int) -> ModelConfig:
    return replace(config, attention_module="multiquery_attention", extra_attention_params={"num_kv_groups": groups})


def tokens(length: int = 12, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)[0]


def reference_attention(attn: torch.nn.Module, x: torch.Tensor, visible: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention written out head by head (no SDPA): query head h reads key/value head
    h // (heads / kv_heads); ``visible`` (T, T) says which keys each query sees."""
    batch, seq, _ = x.shape
    heads, kv_heads, dim = attn.num_heads, attn.kv_heads, attn.head_dim
    q = attn.proj_q_dense_layer(x).view(batch, seq, heads, dim)
    k = attn.proj_k_dense_layer(x).view(batch, seq, kv_heads, dim)
    v = attn.proj_v_dense_layer(x).view(batch, seq, kv_heads, dim)
    out = torch.empty(batch, seq, heads, dim)
    for h in range(heads):
        g = h // (heads // kv_heads)
        scores = q[:, :, h] @ k[:, :, g].transpose(1, 2) * attn.scale
        if bias is not None:
            scores = scores + bias[h]
        out[:, :, h] = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v[:, :, g]
    return attn.proj_output_dense_layer(out.reshape(batch, seq, heads * dim))


def band(length: int, window: int) -> torch.Tensor:
    i, j = torch.meshgrid(torch.arange(length), torch.arange(length), indexing="ij")
    return (i - j >= 0) & (i - j < window)


# ----------------------------------------------------------------------------- grouped-query attention
@settings(max_examples=8)
@given(st.sampled_from([(4, 1), (4, 2), (8, 2), (8, 4), (2, 2)]))
def test_gqa_equals_mha_with_key_value_heads_repeated(heads_groups):
    heads, groups = heads_groups
    config = gqa(replace(LLAMA, num_heads=heads), groups)
    grouped = build_model(config, seed=1)
    full = build_model(replace(config, attention_module="aiayn_attention", extra_attention_params=None), seed=2)
    state, dim = grouped.state_dict(), config.head_dim
    for name, weight in state.items():
        if "proj_k_dense_layer" in name or "proj_v_dense_layer" in name:
            assert weight.shape == (groups * dim, config.hidden_size)
            # MHA with head h's k/v = group h // (heads / groups)'s: repeat each group's rows
            state[name] = weight.view(groups, dim, -1).repeat_interleave(heads // groups, 0).reshape(heads * dim, -1)
    full.load_state_dict(state)
    ids = tokens()
    assert torch.allclose(logits(grouped, ids), logits(full, ids), atol=1e-5)
    expected_saving = 2 * LLAMA.num_hidden_layers * (heads - groups) * dim * config.hidden_size
    assert full.num_parameters() - grouped.num_parameters() == expected_saving


def test_gqa_attention_matches_the_written_out_reference():
    model = build_model(gqa(GPT, 2), seed=0)
    attn = model.transformer_decoder.layers[0].self_attn
    x = torch.randn(2, 10, GPT.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(attn(x, None, None), reference_attention(attn, x, band(10, 10)), atol=1e-5)


def test_multiquery_without_groups_is_one_key_value_head_and_bad_groups_are_refused():
    model = build_model(replace(GPT, attention_module="multiquery_attention"), seed=0)
    assert model.transformer_decoder.layers[0].self_attn.proj_k_dense_layer.out_features == GPT.head_dim
    with pytest.raises(ValueError, match="num_kv_groups .*3.* divisor of num_heads"):
        gqa(GPT, 3)
    with pytest.raises(ValueError, match="needs model.attention_module: multiquery_attention"):
        replace(GPT, extra_attention_params={"num_kv_groups": 2})


def test_attention_inner_dim_narrows_the_heads_not_the_stream():
    config = replace(gqa(LLAMA, 2), attention_inner_dim=16)  # Mistral-Nemo's shape, scaled down
    model = build_model(config, seed=0)
    attn = model.transformer_decoder.layers[0].self_attn
    assert attn.proj_q_dense_layer.weight.shape == (16, 32) and attn.proj_k_dense_layer.weight.shape == (8, 32)
    assert attn.proj_output_dense_layer.weight.shape == (32, 16)
    assert logits(model, tokens()).shape == (2, 12, 64)


# ----------------------------------------------------------------------------- sliding window
def test_sliding_window_is_full_attention_with_a_banded_mask():
    attn = build_model(gqa(GPT, 2), seed=0).transformer_decoder.layers[0].self_attn
    x = torch.randn(1, 12, GPT.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        windowed = attn(x, None, visible_keys(12, 4, None))
        assert torch.allclose(windowed, reference_attention(attn, x, band(12, 4)), atol=1e-5)
        sinks = band(12, 4) | (torch.arange(12)[None, :] < 2) & band(12, 12)
        assert torch.allclose(attn(x, None, visible_keys(12, 4, 2)), reference_attention(attn, x, sinks), atol=1e-5)


def test_sliding_window_differs_from_full_attention_only_beyond_the_window():
    full = build_model(LLAMA, seed=0)
    windowed = build_model(replace(LLAMA, attention_sliding_window_length=4), seed=0)
    ids = tokens(16)
    a, b = logits(full, ids), logits(windowed, ids)
    assert torch.equal(full.state_dict()["lm_head.weight"], windowed.state_dict()["lm_head.weight"])
    assert torch.allclose(a[:, :4], b[:, :4], atol=1e-5)  # within the window nothing is cut off
    assert not torch.allclose(a[:, 4:], b[:, 4:], atol=1e-3)
    longer = build_model(replace(LLAMA, attention_sliding_window_length=16), seed=0)
    assert torch.allclose(a, logits(longer, ids), atol=1e-5)


# ----------------------------------------------------------------------------- ALiBi
def test_alibi_slopes_are_the_papers():
    assert alibi_slopes(8) == [2.0 ** -k for k in range(1, 9)]
    assert alibi_slopes(16) == pytest.approx([2.0 ** (-k / 2) for k in range(1, 17)])
    # 12 heads: the 8-head slopes, then the odd-numbered 16-head slopes
    assert alibi_slopes(12) == pytest.approx([2.0 ** -k for k in range(1, 9)] + [2.0 ** (-k / 2) for k in (1, 3, 5, 7)])


def test_alibi_bias_is_translation_invariant_and_used():
    config = replace(GPT, position_embedding_type="alibi", num_heads=4)
    model = build_model(config, seed=0)
    bias = model.embedding_layer.position_embed_helper(10, None)
    assert bias.shape == (4, 10, 10)
    assert torch.allclose(bias[:, 3:, 3:], bias[:, :7, :7])  # depends on i - j only
    assert torch.allclose(bias[:, 5, 2], -3 * torch.tensor(alibi_slopes(4)))
    attn, x = model.transformer_decoder.layers[0].self_attn, torch.randn(1, 10, config.hidden_size)
    mask = model.attention_mask(10, None, None)
    with torch.no_grad():
        assert torch.allclose(attn(x, None, mask), reference_attention(attn, x, band(10, 10), bias), atol=1e-5)
    ids = tokens()
    before = logits(model, ids)
    model.embedding_layer.position_embed_helper.slopes.zero_()
    assert not torch.allclose(before, logits(model, ids), atol=1e-4)
    assert not any("position" in name for name, _ in model.named_parameters())  # fixed slopes: no parameter
    scaled = build_model(replace(config, pos_scaling_factor=2.0), seed=0).embedding_layer.position_embed_helper
    assert torch.allclose(scaled(10, None), bias / 2)


def test_trainable_alibi_slopes_learn():
    model = build_model(replace(GPT, position_embedding_type="alibi", alibi_trainable_slopes=True), seed=0)
    slopes = dict(model.named_parameters())["embedding_layer.position_embed_helper.slopes"]
    _, loss = model(tokens(), tokens(seed=1))
    loss.backward()
    assert slopes.shape == (4, 1) and slopes.grad is not None and slopes.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- RoPE scaling
def test_linear_rope_scaling_divides_positions_by_the_factor():
    cos, sin = rope_tables(8, 64, 10000.0)
    cos4, sin4 = rope_tables(8, 64, 10000.0, scaling_type="linear", factor=4.0)
    assert torch.allclose(cos4[::4], cos[:16], atol=1e-5) and torch.allclose(sin4[::4], sin[:16], atol=1e-5)
    model = build_model(replace(LLAMA, pos_scaling_factor=4.0), seed=0)
    assert torch.allclose(model.rope(64, None)[0], cos4)


def test_llama3_scaling_keeps_high_frequencies_and_divides_low_ones():
    args = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    base, _ = rope_frequencies(128, 500000.0)
    scaled, mscale = rope_frequencies(128, 500000.0, "llama3", 8.0, args)
    wavelength = 2 * math.pi / base
    high, low = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert high.sum() > 0 and low.sum() > 0 and (~high & ~low).sum() > 0
    assert torch.equal(scaled[high], base[high]) and torch.allclose(scaled[low], base[low] / 8)
    between = ~high & ~low
    assert ((scaled[between] < base[between]) & (scaled[between] > base[between] / 8)).all()
    assert mscale == 1.0


def test_yarn_keeps_fast_pairs_interpolates_slow_ones_and_sets_the_temperature():
    base, _ = rope_frequencies(64, 10000.0)
    scaled, mscale = rope_frequencies(64, 10000.0, "YaRN", 4.0, {"original_max_position_embeddings": 2048})
    assert torch.equal(scaled[:4], base[:4]) and torch.allclose(scaled[-4:], base[-4:] / 4)
    assert mscale == pytest.approx(0.1 * math.log(4.0) + 1.0)
    cos, _ = rope_tables(64, 8, 10000.0, scaling_type="yarn", factor=4.0,
                         scaling_args={"original_max_position_embeddings": 2048})
    assert torch.allclose(cos[0], torch.full((32,), mscale))


def test_bad_scaling_keys_are_refused_naming_them():
    with pytest.raises(ValueError, match="pos_scaling_extra_args.beta_fast is not read by pos_scaling_type llama3"):
        replace(LLAMA, pos_scaling_type="llama3", pos_scaling_extra_args={"beta_fast": 32})
    with pytest.raises(ValueError, match="needs \\['original_max_position_embeddings'\\]"):
        replace(LLAMA, pos_scaling_type="yarn", pos_scaling_factor=4.0)
    with pytest.raises(ValueError, match="rotary and alibi positions only"):
        replace(GPT, pos_scaling_factor=2.0)


# ----------------------------------------------------------------------------- muP
def _decoder_input(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    seen = []
    handle = model.transformer_decoder.layers[0].register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    logits(model, ids)
    handle.remove()
    return seen[0]


def test_mup_scalars_scale_embeddings_attention_and_logits():
    ids, base = tokens(), build_model(GPT, seed=0)
    scaled = build_model(replace(GPT, embeddings_scale=10.0), seed=0)
    assert torch.allclose(_decoder_input(scaled, ids), 10 * _decoder_input(base, ids))
    given_scale = build_model(replace(GPT, output_logits_scale=0.25), seed=0)
    assert torch.allclose(logits(given_scale, ids), 0.25 * logits(base, ids), atol=1e-6)
    # muP: alpha * base / hidden, or its square root without scale_output_logits_by_d. Zero block
    # weights (muP leaves zeros zero) make the blocks add nothing, so the logits differ only by it.
    init = {"name": "zeros"}
    plain = replace(GPT, initializer=init, output_layer_initializer=init,
                    embedding_initializer={"name": "normal", "std": 1.0})
    mup = replace(plain, mup_base_hidden_size=8, mup_base_filter_size=12, output_logits_alpha=2.0)
    reference = logits(build_model(plain, seed=0), ids)
    assert torch.allclose(logits(build_model(mup, seed=0), ids), 2.0 * 8 / 32 * reference, atol=1e-6)
    root = replace(mup, scale_output_logits_by_d=False)
    assert torch.allclose(logits(build_model(root, seed=0), ids), 2.0 * math.sqrt(8 / 32) * reference, atol=1e-6)
    # scale_qk_dot_by_d: QKᵀ / d instead of / sqrt(d), times attention_logits_alpha
    mup_attention = build_model(replace(GPT, scale_qk_dot_by_d=True, attention_logits_alpha=1.5), seed=0)
    attn = mup_attention.transformer_decoder.layers[0].self_attn
    assert attn.scale == pytest.approx(1.5 / GPT.head_dim)
    x = torch.randn(1, 8, GPT.hidden_size)
    with torch.no_grad():
        assert torch.allclose(attn(x, None, None), reference_attention(attn, x, band(8, 8)), atol=1e-5)


def test_mup_initializers_and_logit_scale_reproduce_the_published_explicit_values():
    # Cerebras-GPT 111M muP (2.x file): base sizes; its 1.x file spelled out the same numbers.
    spec = JobSpec.model_validate({"model": {
        "hidden_size": 768, "num_hidden_layers": 10, "num_heads": 12, "filter_size": 3072,
        "vocab_size": 50257, "max_position_embeddings": 2048,
        "initializer": {"name": "truncated_normal", "mean": 0.0, "std": 0.08, "a": -0.16, "b": 0.16},
        "output_layer_initializer": {"name": "truncated_normal", "mean": 0.0, "std": 0.08, "a": -0.16, "b": 0.16},
        "mup_base_hidden_size": 256, "mup_base_filter_size": 1024, "output_logits_alpha": 1.0,
        "scale_qk_dot_by_d": True, "embeddings_scale": 10}})
    config = model_config(spec, 50257, 2048)
    specs = initializers(config)
    assert specs["block"]["std"] == pytest.approx(0.046188021535170064)
    assert specs["block"]["b"] == pytest.approx(0.09237604307034013)
    assert specs["output"]["std"] == pytest.approx(0.010327955589886445)
    assert config.logits_scale == pytest.approx(0.3333333333333333)
    # BTLM-3B-8K: output_logits_alpha 2.22 with base 256 at hidden 2560 -> the 1.x 0.222
    btlm = replace(config, hidden_size=2560, num_heads=32, output_logits_alpha=2.22)
    assert btlm.logits_scale == pytest.approx(0.22200000000000003)
    with pytest.raises(ValueError, match="not both"):
        replace(config, output_logits_scale=0.3)


def test_mup_learning_rates_are_divided_by_the_width_multipliers():
    from training.build import lr_lambda, make_optimizer
    from csx_config import OptimizerSpec

    config = replace(GPT, nonlinearity="swiglu", mup_base_hidden_size=8, mup_base_filter_size=16)  # x4, x3
    spec = OptimizerSpec(optimizer_type="SGD", learning_rate=0.5, weight_decay=0.1)
    model = build_model(config, seed=0)
    optimizer = make_optimizer(spec, model)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec))
    assert optimizer.param_groups[0]["lr"] == 0.5  # the schedule's rate, as train.py logs it
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(tokens(), tokens(seed=1))[1].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    scales = {"self_attn.proj_q_dense_layer.weight": 8 / 32, "self_attn.proj_output_dense_layer.weight": 8 / 32,
              "ffn.ffn.0.linear_layer_for_glu.weight": 8 / 32, "ffn.ffn.1.linear_layer.weight": 16 / 48,
              "ffn.ffn.1.linear_layer.bias": 1.0, "norm1.weight": 1.0}
    scales = {f"transformer_decoder.layers.0.{name}": scale for name, scale in scales.items()}
    scales["embedding_layer.word_embeddings.weight"] = 1.0
    for name, p in model.named_parameters():
        if name in scales:  # SGD: w -= lr * scale * (g + wd * w), decay on matrices only
            decay = 0.1 * before[name] if p.dim() >= 2 else 0.0
            assert torch.allclose(before[name] - p.detach(), 0.5 * scales[name] * (grads[name] + decay), atol=1e-7), name


def test_the_1x_adjust_learning_rate_scales_every_decoder_kernel():
    from training.build import make_optimizer
    from csx_config import OptimizerSpec

    model = build_model(replace(GPT, nonlinearity="swiglu"), seed=0)
    optimizer = make_optimizer(OptimizerSpec(optimizer_type="SGD"), model, {"decoder_kernel": 1 / 3})
    names = {id(p): n for n, p in model.named_parameters()}
    rate = {names[id(p)]: group["lr"] for group in optimizer.param_groups for p in group["params"]}
    kernels = {n for n in rate if n.startswith("transformer_decoder.layers.") and n.endswith(".weight")
               and "norm" not in n}
    assert len(kernels) == 2 * 7 and all(rate[n] == pytest.approx(1 / 3) for n in kernels)
    assert all(rate[n] == 1.0 for n in set(rate) - kernels)  # embeddings, norms, biases
    with pytest.raises(ValueError, match="adjust_learning_rate.decoder_kernal is not one of"):
        make_optimizer(OptimizerSpec(), model, {"decoder_kernal": 0.5})


def test_the_files_adjust_learning_rate_reaches_the_training_optimizer(tmp_path):
    from training.build import build_run

    spec = JobSpec.from_yaml("model: {preset: tiny}\ntrain_input: {batch_size: 2, max_sequence_length: 16}\n"
                             "optimizer: {learning_rate: 0.01, adjust_learning_rate: {decoder_kernel: 0.25}}\n")
    run = build_run(plan_job(spec, 1), tmp_path, rank=0, device=torch.device("cpu"))
    names = {id(p): n for n, p in run.model.named_parameters()}
    factor = {names[id(p)]: group["initial_lr"] for group in run.optimizer.param_groups for p in group["params"]}
    kernels = {n for n in factor if n.startswith("transformer_decoder.") and n.endswith(".weight") and "norm" not in n}
    assert kernels and all(factor[n] == 0.25 for n in kernels)
    assert all(factor[n] == 1.0 for n in set(factor) - kernels)
    with pytest.raises(ValueError, match="adjust_learning_rate.decoder_kernal is not one of"):
        JobSpec.from_yaml("optimizer: {adjust_learning_rate: {decoder_kernal: 0.25}}")


def test_projections_cost_attention_at_its_inner_width_and_window():
    from service.full_size import full_size_layers
    from simulator.cost_model import layers_from_model

    model = {"preset": "tiny", "hidden_size": 64, "num_heads": 4, "attention_inner_dim": 32,
             "max_position_embeddings": 64, "attention_sliding_window_length": 8, "attention_sink_tokens": 2}
    layers, _, _ = full_size_layers({"model": model, "train_input": {"max_sequence_length": 64}})
    scores = [(layer.out_features, layer.in_features) for layer in layers if layer.name.endswith(".scores")]
    assert scores and set(scores) == {(2 * (8 + 2), 32)}
    built = build_model(model_config(JobSpec.model_validate({"model": model}), 256, 64), seed=0)
    live = [(layer.out_features, layer.in_features) for layer in layers_from_model(built, seq_tokens=64)
            if layer.name.endswith(".scores")]
    assert live == scores


# ----------------------------------------------------------------------------- biases, tying
@pytest.mark.parametrize("flag, names", [
    ("use_projection_bias_in_attention", [f"self_attn.proj_{x}_dense_layer.bias" for x in "qkv"]),
    ("use_ffn_bias_in_attention", ["self_attn.proj_output_dense_layer.bias"]),
    ("use_ffn_bias", ["ffn.ffn.0.linear_layer.bias", "ffn.ffn.0.linear_layer_for_glu.bias",
                      "ffn.ffn.1.linear_layer.bias"]),
    ("use_bias_in_output", []),
])
def test_each_bias_key_adds_exactly_its_biases(flag, names):
    off = replace(gqa(LLAMA, 2), use_projection_bias_in_attention=False, use_ffn_bias_in_attention=False,
                  use_ffn_bias=False, use_bias_in_output=False)
    without = {n for n, _ in build_model(off, seed=0).named_parameters()}
    model = build_model(replace(off, **{flag: True}), seed=0)
    parameters = dict(model.named_parameters())
    expected = {f"transformer_decoder.layers.{i}.{name}" for i in range(LLAMA.num_hidden_layers) for name in names}
    assert set(parameters) - without == (expected or {"lm_head.bias"})
    assert all(parameters[name].abs().sum() == 0 for name in set(parameters) - without)  # biases start at 0
    assert logits(model, tokens()).shape == (2, 12, 64)


def test_tied_head_is_the_embedding_and_untied_is_not():
    tied, untied = build_model(LLAMA, seed=0), build_model(replace(LLAMA, share_embedding_weights=False), seed=0)
    assert tied.lm_head.weight is tied.embedding_layer.word_embeddings.weight
    assert untied.lm_head.weight is not untied.embedding_layer.word_embeddings.weight
    assert untied.num_parameters() - tied.num_parameters() == LLAMA.vocab_size * LLAMA.hidden_size


# ----------------------------------------------------------------------------- published sizes
_GPT3 = {"position_embedding_type": "learned", "max_position_embeddings": 2048, "vocab_size": 50257,
         "share_embedding_weights": True, "nonlinearity": "gelu"}
_LLAMA = {"position_embedding_type": "rotary", "norm_type": "rmsnorm", "nonlinearity": "swiglu",
          "share_embedding_weights": False, "use_projection_bias_in_attention": False,
          "use_ffn_bias_in_attention": False, "use_ffn_bias": False}
_GQA8 = {"attention_module": "multiquery_attention", "extra_attention_params": {"num_kv_groups": 8}}
# (name, the published config's model keys, the published size, how exact it is published)
PUBLISHED = [
    ("GPT-2 small", {**_GPT3, "max_position_embeddings": 1024, "hidden_size": 768, "num_hidden_layers": 12,
                     "num_heads": 12, "filter_size": 3072}, 124_439_808, 0),
    ("GPT-3 125M", {**_GPT3, "hidden_size": 768, "num_hidden_layers": 12, "num_heads": 12,
                    "filter_size": 3072}, 125e6, 0.01),
    ("Cerebras-GPT 111M", {**_GPT3, "hidden_size": 768, "num_hidden_layers": 10, "num_heads": 12,
                           "filter_size": 3072}, 111e6, 0.01),
    ("GPT-3 XL 1.3B", {**_GPT3, "hidden_size": 2048, "num_hidden_layers": 24, "num_heads": 16,
                       "filter_size": 8192}, 1.3e9, 0.02),
    ("Cerebras-GPT 2.7B", {**_GPT3, "hidden_size": 2560, "num_hidden_layers": 32, "num_heads": 32,
                           "filter_size": 10240}, 2.7e9, 0.02),
    ("GPT-3 6.7B", {**_GPT3, "hidden_size": 4096, "num_hidden_layers": 32, "num_heads": 32,
                    "filter_size": 16384}, 6.7e9, 0.01),
    ("Cerebras-GPT 13B", {**_GPT3, "hidden_size": 5120, "num_hidden_layers": 40, "num_heads": 40,
                          "filter_size": 20480}, 13e9, 0.02),
    ("BTLM-3B-8K", {"hidden_size": 2560, "position_embedding_type": "alibi", "max_position_embeddings": 8192,
                    "vocab_size": 50257, "num_hidden_layers": 32, "num_heads": 32, "filter_size": 6826,
                    "nonlinearity": "swiglu", "mup_base_hidden_size": 256, "mup_base_filter_size": 682.6,
                    "output_logits_alpha": 2.22, "scale_qk_dot_by_d": True, "embeddings_scale": 14.6}, 2.6e9, 0.02),
    ("Llama-2 7B", {**_LLAMA, "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32, "num_heads": 32,
                    "filter_size": 11008, "max_position_embeddings": 4096}, 6_738_415_616, 0),
    ("Llama-2 13B", {**_LLAMA, "vocab_size": 32000, "hidden_size": 5120, "num_hidden_layers": 40, "num_heads": 40,
                     "filter_size": 13824, "max_position_embeddings": 4096}, 13_015_864_320, 0),
    ("Llama-3 8B", {**_LLAMA, **_GQA8, "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
                    "num_heads": 32, "filter_size": 14336, "max_position_embeddings": 8192,
                    "rope_theta": 500000.0}, 8_030_261_248, 0),
    ("Llama-3.1 8B", {**_LLAMA, **_GQA8, "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
                      "num_heads": 32, "filter_size": 14336, "max_position_embeddings": 131072,
                      "rope_theta": 500000.0, "pos_scaling_type": "llama3", "pos_scaling_factor": 8.0,
                      "pos_scaling_extra_args": {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 8192}}, 8_030_261_248, 0),
    ("Mistral 7B", {**_LLAMA, **_GQA8, "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
                    "num_heads": 32, "filter_size": 14336, "max_position_embeddings": 32768,
                    "attention_sliding_window_length": 4096}, 7_241_732_096, 0),
    ("Mistral-Nemo 12B", {**_LLAMA, **_GQA8, "vocab_size": 131072, "hidden_size": 5120, "attention_inner_dim": 4096,
                          "num_hidden_layers": 40, "num_heads": 32, "filter_size": 14336,
                          "max_position_embeddings": 131072, "rope_theta": 1e6}, 12_247_782_400, 0),
]


@pytest.mark.parametrize("name, keys, published, tolerance", PUBLISHED, ids=[row[0] for row in PUBLISHED])
def test_parameter_counts_equal_the_published_sizes(name, keys, published, tolerance):
    spec = JobSpec.model_validate({"model": keys, "train_input": {"batch_size": 8}})
    plan = plan_report(plan_job(spec, 1))  # the meta device: no weights are allocated
    assert plan["model"]["parameters"] == pytest.approx(published, rel=tolerance, abs=0)
    assert f"{plan['model']['parameters']:,} parameters" in plan_table(plan)


# ----------------------------------------------------------------------------- plans for schedules
def _scheduled_plan(sparsity: dict) -> dict:
    model = {"hidden_size": 1024, "num_hidden_layers": 2, "num_heads": 16, "filter_size": 4096,
             "max_position_embeddings": 512}
    spec = JobSpec.model_validate({"model": model, "train_input": {"batch_size": 8, "max_sequence_length": 512},
                                   "runconfig": {"max_steps": 1000}, "sparsity": sparsity})
    return plan_report(plan_job(spec, 1))


@pytest.mark.parametrize("sparsity", [
    {"algorithm": "gmp", "sparsity": {"type": "cubic", "init_sparsity": 0.0, "end_sparsity": 0.9,
                                      "sparsity_start_step": 0, "sparsity_end_step": 500,
                                      "prune_every_k_steps": 50}, "update": {"freq": 50, "stop": 501}},
    {"algorithm": "gmp", "sparsity": {"type": "linear", "init": 0.0, "slope": 0.0018},
     "update": {"freq": 100, "stop": 600}},
], ids=["cubic", "gmp-linear"])
def test_schedule_plans_show_the_target_reached_and_its_speedup(sparsity):
    plan = _scheduled_plan(sparsity)
    start, final = plan["schedule"]["start"], plan["schedule"]["final"]
    assert start["step"] == 0 and start["sparsity"] == 0.0 and start["speedup_vs_dense"] == pytest.approx(1.0)
    assert final["step"] == 500 and final["sparsity"] == pytest.approx(0.9, abs=1e-4)
    assert final["speedup_vs_dense"] > 1.2 and final["sparse_train_flops"] < start["sparse_train_flops"]
    assert plan["projection"]["speedup_vs_dense"] == final["speedup_vs_dense"]
    sparse = [layer for layer in plan["layers"] if layer["sparse"]]
    assert all(layer["start_sparsity"] == 0.0 and layer["sparsity"] == pytest.approx(0.9, abs=1e-4) for layer in sparse)
    table = plan_table(plan)
    assert "step 0: 0.000" in table and "step 500: 0.900" in table


def test_constant_sparsity_plans_start_at_their_target():
    plan = _scheduled_plan({"algorithm": "rigl", "sparsity": 0.75, "update": {"freq": 100}})
    start, final = plan["schedule"]["start"], plan["schedule"]["final"]
    assert start["sparsity"] == final["sparsity"] == pytest.approx(0.75, abs=1e-4)
    assert "sparsity schedule" not in plan_table(plan)


# ----------------------------------------------------------------------------- spec keys
def test_published_llama31_keys_validate_and_build_what_they_say():
    spec = JobSpec.from_yaml("""
model:
  name: llama
  attention_module: multiquery_attention
  extra_attention_params: {num_kv_groups: 2}
  embedding_layer_norm: false
  hidden_size: 64
  num_heads: 8
  num_hidden_layers: 2
  filter_size: 96
  max_position_embeddings: 256
  nonlinearity: swiglu
  norm_type: rmsnorm
  position_embedding_type: rotary
  pos_scaling_extra_args: {high_freq_factor: 4.0, low_freq_factor: 1.0, original_max_position_embeddings: 64}
  pos_scaling_factor: 8.0
  pos_scaling_type: llama3
  rope_theta: 500000.0
  rotary_dim: 8
  share_embedding_weights: false
  attention_sliding_window_length: 32
  attention_sink_tokens: 4
""")
    config = model_config(spec, 256, 128)
    assert (config.kv_heads, config.pos_scaling_type, config.attention_sliding_window_length) == (2, "llama3", 32)
    model = build_model(config, seed=0)
    assert logits(model, tokens(40, 256)).shape == (2, 40, 256)
    with pytest.raises(ValueError, match="extra_attention_params.num_kv_grups .*did you mean 'num_kv_groups'"):
        JobSpec.model_validate({"model": {"extra_attention_params": {"num_kv_grups": 2}}})
    with pytest.raises(ValueError, match="pos_scaling_type"):
        JobSpec.model_validate({"model": {"pos_scaling_type": "longrope"}})


# ----------------------------------------------------------------------------- sparse layers, fabric
def test_gqa_projections_train_sparse_on_the_simulated_fabric():
    import sparsity
    from simulator.layers import CSRLinear, compile_model

    config = gqa(replace(LLAMA, num_heads=8), 2)
    model = build_model(config, seed=0)
    alg = sparsity.configure({"algorithm": "static", "sparsity": 0.5, "seed": 0})
    alg.apply(model)
    ids, targets = tokens(), tokens(seed=1)
    dense_logits, dense_loss = model(ids, targets)
    dense_loss.backward()
    dense_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compile_model(model, alg, kernel="csr")
    k = model.transformer_decoder.layers[0].self_attn.proj_k_dense_layer
    assert isinstance(k, CSRLinear) and k.weight.shape == (2 * config.head_dim, config.hidden_size)
    csr_logits, csr_loss = model(ids, targets)
    csr_loss.backward()
    assert torch.allclose(csr_logits, dense_logits, atol=1e-5)
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, dense_grads[name], atol=1e-5), name


# ----------------------------------------------------------------------------- family proxies learn
FAMILY_PROXIES = {
    "llama-3.1": replace(gqa(LLAMA, 2), rope_theta=500000.0, pos_scaling_type="llama3", pos_scaling_factor=8.0,
                         pos_scaling_extra_args={"original_max_position_embeddings": 8}),
    "mistral": replace(gqa(LLAMA, 2), attention_sliding_window_length=4),
    "btlm": replace(GPT, position_embedding_type="alibi", nonlinearity="swiglu", mup_base_hidden_size=8,
                    mup_base_filter_size=12, output_logits_alpha=2.22, scale_qk_dot_by_d=True, embeddings_scale=14.6),
    "cerebras-gpt-mup": replace(GPT, mup_base_hidden_size=8, mup_base_filter_size=12, scale_qk_dot_by_d=True,
                                embeddings_scale=10.0),
}


@pytest.mark.parametrize("family", FAMILY_PROXIES)
def test_family_proxies_fit_a_batch(family):
    from training.build import lr_lambda, make_optimizer
    from csx_config import OptimizerSpec

    model = build_model(FAMILY_PROXIES[family], seed=0)
    spec = OptimizerSpec(optimizer_type="AdamW", learning_rate=1e-2)
    optimizer = make_optimizer(spec, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec))
    ids = tokens(16)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = model(ids, ids.roll(-1, dims=1))[1]
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    assert all(math.isfinite(value) for value in losses) and losses[-1] < 0.5 * losses[0]


def test_embedding_layer_norm_normalises_what_the_blocks_see():
    model = build_model(replace(GPT, embedding_layer_norm=True, embeddings_scale=3.0, layer_norm_epsilon=1e-12), seed=0)
    names = {n for n, _ in model.named_parameters()}
    assert {"embedding_ln_f.weight", "embedding_ln_f.bias"} <= names
    x = _decoder_input(model, tokens())
    assert torch.allclose(x.mean(-1), torch.zeros(x.shape[:-1]), atol=1e-5)  # LayerNorm, then x 3
    assert torch.allclose(x.std(-1, unbiased=False), torch.full(x.shape[:-1], 3.0), atol=1e-3)


def test_checkpoints_written_before_the_new_model_keys_still_load(tmp_path):
    from dataclasses import asdict

    from training.checkpoint import load_model_state

    model = build_model(LLAMA, seed=0)
    current = asdict(LLAMA)
    older = {k: v for k, v in current.items() if k not in ("attention_module", "pos_scaling_type", "embeddings_scale")}
    state = {"model": build_model(LLAMA, seed=1).state_dict(), "model_config": older}
    load_model_state(model, None, state, tmp_path / "old.pt", current)
    assert torch.equal(model.lm_head.weight, state["model"]["lm_head.weight"])
    with pytest.raises(ValueError, match="was trained with model"):
        load_model_state(model, None, {**state, "model_config": {**older, "embeddings_scale": 2.0}},
                         tmp_path / "old.pt", current)
