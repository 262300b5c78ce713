"""The decoder families beyond GPT-2/3 and Llama (issue 33), each feature on a tiny proxy
against an independent computation: GPT-J/NeoX/Falcon's parallel block, MPT's biasless
LayerNorm, StarCoder's layer-index scaling, Gemma-2's soft-capping, sandwich norms and
alternating window, Mixtral's mixture of experts with its load-balancing loss, the
variance_scaling initializer; the published parameter counts of one file per family (meta
device); the model class that model.name selects, and hints that cannot change the model."""

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

import sparsity
from csx_config import JobSpec, format_problems
from csx_config.keys import HINTS, same_spelling, unknown_key_message
from csx_config.model import ModelSpec
from test_model_features import GPT, LLAMA, band, reference_attention, tokens
from csx import cli
from training.plan import model_config, plan_job
from training.data import planned_shapes
from models.initializers import variance_scaling_
from models.moe import load_balancing_loss
from models.positions import visible_keys
from models.transformer import build_model
from training.report import plan_report, plan_table

torch.set_num_threads(1)
CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "modelzoo_corpus"
GPTJ = replace(GPT, model_class="GPTJModel", position_embedding_type="rotary", rotary_dim=4)
MOE = {"num_experts": 4, "top_k": 2, "load_balancing_loss_coef": 0.02}


def hidden(n: int = 8, width: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, n, width, generator=torch.Generator().manual_seed(seed))


def ffn_by_hand(ffn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """GELU MLP from the weights: fc1, GELU, fc2."""
    first, second = ffn.ffn[0].linear_layer, ffn.ffn[1].linear_layer
    return F.linear(F.gelu(F.linear(x, first.weight, first.bias)), second.weight, second.bias)


# ----------------------------------------------------------------------------- GPT-J / NeoX / Falcon
@pytest.mark.parametrize("untied", [False, True])
def test_parallel_block_adds_attention_and_mlp_of_the_same_input(untied):
    config = replace(GPTJ, use_untied_layer_norm=untied)
    layer = build_model(config, seed=0).transformer_decoder.layers[0]
    assert hasattr(layer, "norm3") == untied  # GPT-J: one norm feeds both; NeoX: norm3 for the MLP
    with torch.no_grad():
        for norm in (layer.norm1, getattr(layer, "norm3", layer.norm1)):
            norm.weight.normal_(generator=torch.Generator().manual_seed(len(norm.weight)))
        x = hidden()
        ln1 = F.layer_norm(x, (32,), layer.norm1.weight, layer.norm1.bias)
        ln3 = F.layer_norm(x, (32,), layer.norm3.weight, layer.norm3.bias) if untied else ln1
        rope = build_model(config, seed=0).rope(8, None)
        expected = x + layer.self_attn(ln1, rope, None) + ffn_by_hand(layer.ffn, ln3)
        assert torch.allclose(layer(x, rope, None), expected, atol=1e-5)


def test_neox_file_builds_the_parallel_block_and_residual_dropout_is_its_dropout():
    spec = JobSpec.from_yaml((CORPUS / "gptj/params_v2/r2.2.1_params_gpt_neox_20B.yaml").read_text(),
                             ["model.residual_dropout_rate=0.25", "model.dropout_rate=0.25"])
    assert spec.model.model_class == "GPTJModel" and spec.model.dropout_rate == 0.25
    config = model_config(spec, *planned_shapes(spec))
    assert config.is_parallel and config.use_untied_layer_norm
    # The class survives a dump without model.name (stored specs and checkpoints are re-read),
    # and a dump's unset keys (None) of the other class are no keys of it.
    assert JobSpec.from_yaml(spec.to_yaml()).model.model_class == "GPTJModel"
    assert JobSpec.model_validate(spec.model_dump()).model.model_class == "GPTJModel"
    gemma = JobSpec.from_yaml((CORPUS / "gemma2/trainer/r2.5.0_params_gemma2_9b_msl8k.yaml").read_text())
    assert JobSpec.model_validate(gemma.model_dump()).model.model_class == "GPT2LMHeadModel"


def test_a_parallel_block_key_under_another_model_name_names_its_family():
    err = _problems({"model": {"name": "gpt2", "use_untied_layer_norm": True, "residual_dropout_rate": 0.0,
                               "hidden_sise": 8}})
    assert "model.use_untied_layer_norm: parallel-block key of GPT-J/NeoX/Falcon" in err
    assert "not read by model.name=gpt2 (GPT2LMHeadModel)" in err
    assert "model.residual_dropout_rate: parallel-block key" in err and "did you mean 'dropout_rate'" not in err
    assert "model.hidden_sise is not a key" in err and "did you mean 'hidden_size'" in err  # all at once
    gemma_key = _problems({"model": {"name": "falcon", "attention_logit_softcapping": 50.0}})
    assert "key of GPT2LMHeadModel" in gemma_key and "model.name=falcon (GPTJModel)" in gemma_key


def _problems(params: dict, overrides: list[str] | None = None) -> str:
    with pytest.raises(ValueError) as err:
        JobSpec.from_yaml(yaml.safe_dump(params), overrides)
    return format_problems(err.value)


# ----------------------------------------------------------------------------- model.name
@pytest.mark.parametrize("path", ["dpo/params_v2/r2.3.0_params_zephyr_7b_dpo.yaml",
                                  "dpo/trainer/r2.5.0_params_zephyr_7b_dpo.yaml"])
def test_dpo_is_refused_in_one_message_naming_it(path):
    err = _problems(yaml.safe_load((CORPUS / path).read_text()))
    assert err.startswith("1 problem in params:\n"), err
    assert "ModelZoo's dpo model (DPO, a policy model" in err and "is not supported here" in err


def test_model_name_selects_the_class_and_an_unknown_name_lists_the_known():
    assert ModelSpec(name="falcon").model_class == "GPTJModel"
    assert ModelSpec(name="mixtral").model_class == "GPT2LMHeadModel"
    unknown = _problems({"model": {"name": "gpt5"}})
    assert "model.name 'gpt5' is not supported here: it is none of ModelZoo's models" in unknown
    assert "decoder-only LMs (bloom, btlm, falcon" in unknown
    assert "ModelZoo's t5 model (T5, an encoder-decoder) is not supported here" in _problems({"model": {"name": "t5"}})


# ----------------------------------------------------------------------------- hints
def test_hints_only_between_spellings_of_one_key():
    known = set(ModelSpec.known_keys())
    # The hints issue 33 found leading to another meaning: none is offered now.
    for key in ("residual_dropout_rate", "use_untied_layer_norm", "scale_qk_dot_by_layer_idx",
                "attention_logit_softcapping", "num_examples"):
        assert "did you mean" not in unknown_key_message(key, known - {key}, "model"), key
    assert "did you mean 'num_heads'" in unknown_key_message("num_haeds", known, "model")
    assert "did you mean 'hidden_size'" in unknown_key_message("Hidden-Size", known, "model")


def test_no_corpus_key_hints_at_a_key_with_another_meaning():
    """Every model key of every corpus file, were it unknown: the key its hint names (if any) is
    another spelling of it, so following a hint cannot build a different model."""
    known = set(ModelSpec.known_keys())
    keys = set()
    for path in CORPUS.glob("*/*/*.yaml"):
        data = yaml.safe_load(path.read_text())
        model = data["trainer"]["init"]["model"] if "trainer" in data else data.get("model", {})
        keys |= set(model)
    assert len(keys) > 60
    for key in keys:
        message = unknown_key_message(key, known - {key}, "model")
        if "did you mean" in message:  # an old spelling's meaning (HINTS), or a misspelling
            target = message.split("did you mean '")[1].rstrip("'?")
            assert HINTS.get(key) == target or same_spelling(key, target), message


def test_batch_not_divisible_by_num_csx_is_reported_with_the_schema_problems(tmp_path, capsys):
    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump({"train_input": {"batch_size": 5}, "model": {"hiden_size": 8}}))
    assert cli.main(["run", "--params", str(params), "--num_csx", "2", "--validate_only"]) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err and "batch_size (5) must divide evenly over num_csx (2)" in err
    assert "did you mean 'hidden_size'" in err


# ----------------------------------------------------------------------------- MPT, StarCoder
def test_biasless_layernorm_has_no_bias_and_normalises_like_layernorm():
    model = build_model(replace(GPT, norm_type="biasless-layernorm"), seed=0)
    assert not any(name.endswith("norm1.bias") for name, _ in model.named_parameters())
    norm, x = model.transformer_decoder.layers[0].norm1, hidden()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        assert torch.allclose(norm(x), (x - mean) / torch.sqrt(var + 1e-5) * norm.weight, atol=1e-5)


def test_scale_qk_dot_by_layer_idx_divides_each_layers_logits_by_its_index_plus_one():
    scaled = build_model(replace(GPT, num_hidden_layers=3, scale_qk_dot_by_layer_idx=True), seed=0)
    plain = build_model(replace(GPT, num_hidden_layers=3), seed=0)
    x = hidden()
    for index, (a, b) in enumerate(zip(scaled.transformer_decoder.layers, plain.transformer_decoder.layers)):
        assert a.self_attn.scale == pytest.approx(b.self_attn.scale / (index + 1))
        with torch.no_grad():
            assert torch.allclose(a.self_attn(x, None, None), reference_attention(a.self_attn, x, band(8, 8)), atol=1e-5)
    # StarCoder's published False changes nothing.
    spec = JobSpec.from_yaml((CORPUS / "starcoder/trainer/r2.5.0_params_starcoder_15b.yaml").read_text())
    assert spec.model.scale_qk_dot_by_layer_idx is False


# ----------------------------------------------------------------------------- Gemma-2
def test_attention_softcapping_caps_the_logits_before_the_mask():
    config = replace(LLAMA, attention_logit_softcapping=0.5, attention_module="multiquery_attention",
                     extra_attention_params={"num_kv_groups": 2})
    attn, x = build_model(config, seed=0).transformer_decoder.layers[0].self_attn, hidden() * 4
    batch, seq = 2, 8
    q = attn.proj_q_dense_layer(x).view(batch, seq, 4, 8)
    k = attn.proj_k_dense_layer(x).view(batch, seq, 2, 8)
    v = attn.proj_v_dense_layer(x).view(batch, seq, 2, 8)
    out = torch.empty(batch, seq, 4, 8)
    for h in range(4):
        scores = q[:, :, h] @ k[:, :, h // 2].transpose(1, 2) * attn.scale
        scores = 0.5 * torch.tanh(scores / 0.5)
        out[:, :, h] = scores.masked_fill(~band(seq, 3), float("-inf")).softmax(-1) @ v[:, :, h // 2]
    expected = attn.proj_output_dense_layer(out.reshape(batch, seq, 32))
    with torch.no_grad():
        assert torch.allclose(attn(x, None, visible_keys(seq, 3, None)), expected, atol=1e-5)


def test_final_softcapping_bounds_the_logits():
    model = build_model(replace(LLAMA, final_logit_softcapping=0.3), seed=0)
    plain = build_model(LLAMA, seed=0)
    ids = tokens(vocab=64)
    with torch.no_grad():
        capped, raw = model(ids)[0], plain(ids)[0]
    assert torch.allclose(capped, 0.3 * torch.tanh(raw / 0.3), atol=1e-6) and capped.abs().max() < 0.3


def test_sandwich_norms_norm_each_sublayer_output():
    layer = build_model(replace(LLAMA, norm_first_sandwich=True), seed=0).transformer_decoder.layers[0]
    names = {name for name, _ in layer.named_parameters()}
    assert {"norm1_post.weight", "norm3_post.weight"} <= names
    x = hidden()
    with torch.no_grad():
        layer.norm1_post.weight.fill_(0.5)
        layer.norm3_post.weight.fill_(2.0)
        rms = lambda t, w: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w  # noqa: E731
        mid = x + rms(layer.self_attn(layer.norm1(x), None, None), 0.5)
        expected = mid + rms(layer.ffn(layer.norm3(mid)), 2.0)
        assert torch.allclose(layer(x, None, None), expected, atol=1e-5)


def test_sliding_window_on_every_other_layer_odd_layers_only():
    config = replace(LLAMA, num_hidden_layers=4, attention_sliding_window_length=3,
                     sliding_window_every_other_decoder_layer=True, position_embedding_type="learned")
    model = build_model(config, seed=0)
    assert [layer.self_attn.window for layer in model.transformer_decoder.layers] == [None, 3, None, 3]
    ids = tokens(vocab=64)
    with torch.no_grad():
        x = model.embedding_layer(ids)
        for index, layer in enumerate(model.transformer_decoder.layers):
            x = layer(x, None, band(12, 3) if index % 2 else band(12, 12))
        expected = model.lm_head(model.transformer_decoder.norm(x))
        assert torch.allclose(model(ids)[0], expected, atol=1e-5)


# ----------------------------------------------------------------------------- Mixtral / MoE
def expert_function(block, index: int):
    """Expert ``index`` of a MoE block (routed ones first, then the shared ones) as a function
    of one token, read off its parameters in the block's layout."""
    experts = block.experts
    if hasattr(experts, "fused_ffns"):
        def weight(layer, name, which="weight"):
            module = getattr(experts.fused_ffns[layer], name)
            return module.expert_weights[:, index, :], (None if module.expert_biases is None
                                                        else module.expert_biases[:, index, 0])

        def fused(token):
            hidden = F.silu(F.linear(token, *weight(0, "linear_layer"))) * F.linear(token, *weight(0, "linear_layer_for_glu"))
            return F.linear(hidden, *weight(1, "linear_layer"))
        return fused
    if hasattr(experts, "shared_experts"):
        if index < block.num_experts:
            return lambda token: experts.experts[index][1](experts.experts[index][0](token))
        return experts.shared_experts[index - block.num_experts]
    return experts.experts[index]


@pytest.mark.parametrize("implementation", ["optimized", "experimental", "functional"])
def test_moe_routes_each_token_to_its_top_k_experts_by_renormalised_probability(implementation):
    config = replace(LLAMA, moe={**MOE, "num_shared_experts": 1, "null_expert_bias": 0.1,
                                 "moe_implementation": implementation})
    block, x = build_model(config, seed=0).transformer_decoder.layers[0].ffn, hidden(n=5)
    with torch.no_grad():
        out = block(x)
        for b in range(2):
            for t in range(5):
                token = x[b, t]
                probs = torch.softmax(block.gate.weight @ token, -1)
                top = sorted(range(4), key=lambda e: -probs[e])[:2]
                norm = sum(probs[e] for e in top) + 0.1
                expected = sum(probs[e] / norm * expert_function(block, e)(token) for e in top)
                expected = expected + expert_function(block, 4)(token)  # the shared expert, weight 1
                assert torch.allclose(out[b, t], expected, atol=1e-5)


def test_load_balancing_loss_is_modelzoos_formula():
    probs = torch.softmax(torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0)), -1)
    chosen = F.one_hot(probs.topk(2).indices, 4).sum(-2).float()
    layers = [(probs, chosen), (probs.flip(1), chosen.roll(1, dims=-1))]
    by_hand = 0.0
    for b in range(2):
        for e in range(4):
            share = sum(float(c[b, :, e].mean()) for _, c in layers) / 2
            prob = sum(float(p[b, :, e].mean()) for p, _ in layers) / 2
            by_hand += share * prob
    assert float(load_balancing_loss(layers)) == pytest.approx(16 * by_hand / 8, rel=1e-6)
    model = build_model(replace(LLAMA, moe=MOE), seed=0)
    ids = tokens(vocab=64)
    with torch.no_grad():
        loss = model(ids, ids)[1]
        plain = F.cross_entropy(model(ids)[0].flatten(0, 1), ids.flatten())
        assert float(loss) == pytest.approx(float(plain + 0.02 * load_balancing_loss(model.routings())), rel=1e-5)
        model.eval()  # evaluation's loss is the LM loss alone (its perplexity is the model's)
        assert float(model(ids, ids)[1]) == pytest.approx(float(plain), rel=1e-6)


def test_router_runs_in_float32_under_autocast_when_router_fp32():
    model = build_model(replace(LLAMA, moe=MOE), seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens(vocab=64))
    assert all(probs.dtype == torch.float32 for probs, _ in model.routings())
    half = build_model(replace(LLAMA, moe={**MOE, "router_fp32": False}), seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half(tokens(vocab=64))
    assert all(probs.dtype == torch.bfloat16 for probs, _ in half.routings())


def test_router_load_is_each_experts_share_of_the_top_k_choices_by_hand():
    model = build_model(replace(LLAMA, moe=MOE), seed=0)
    inputs = []  # what each MoE block's router saw
    for layer in model.transformer_decoder.layers:
        layer.ffn.register_forward_pre_hook(lambda _, args: inputs.append(args[0].detach()))
    with torch.no_grad():
        model(tokens(length=24, vocab=64))
    load = model.router_load()
    assert load.shape == (2, 4)
    for row, (x, layer) in zip(load, zip(inputs, model.transformer_decoder.layers)):
        chosen = (x.reshape(-1, 32) @ layer.ffn.gate.weight.T).topk(2, dim=-1).indices  # softmax keeps the order
        expected = torch.bincount(chosen.flatten(), minlength=4) / chosen.numel()
        assert torch.allclose(row, expected) and float(row.sum()) == pytest.approx(1.0)
    assert build_model(LLAMA, seed=0).router_load() is None


def test_expert_weights_take_modelzoo_names_and_sparsity_leaves_the_router_dense():
    model = build_model(replace(LLAMA, moe={**MOE, "moe_implementation": "functional"}), seed=0)
    names = [name for name, _ in model.named_parameters()]
    assert "transformer_decoder.layers.0.ffn.gate.weight" in names
    assert "transformer_decoder.layers.0.ffn.experts.experts.3.ffn.0.linear_layer.weight" in names
    # ModelZoo's MoE files filter '*linear_layer.weight': every expert matrix, not the router.
    model.apply(sparsity.configure({"algorithm": "static", "sparsity": 0.5,
                                    "param_filter": ["*linear_layer.weight"]}))
    masks = {name for name, _ in model.named_buffers() if name.endswith("_mask")}
    assert "transformer_decoder.layers.1.ffn.experts.experts.2.ffn.1.linear_layer.weight_mask" in masks
    assert not any("gate" in name for name in masks) and len(masks) == 2 * 4 * 2  # layers x experts x (w1, w2)
    for implementation in ("optimized", "experimental", "functional"):
        default = build_model(replace(LLAMA, moe={**MOE, "moe_implementation": implementation}), seed=0)
        default.apply(sparsity.configure(0.5))  # the default filter (every matrix but embeddings / norms / head)
        assert not any("gate" in name for name, _ in default.named_buffers())


# ----------------------------------------------------------------------------- initializers
@pytest.mark.parametrize("distribution, mode", [("normal", "fan_out"), ("truncated_normal", "fan_in"),
                                                ("uniform", "fan_avg")])
def test_variance_scaling_draws_with_variance_scale_over_the_fan(distribution, mode):
    torch.manual_seed(0)
    weight = torch.empty(300, 500)  # fan_out 300, fan_in 500
    variance_scaling_(weight, scale=0.4, mode=mode, distribution=distribution)
    fan = {"fan_in": 500, "fan_out": 300, "fan_avg": 400}[mode]
    assert float(weight.var()) == pytest.approx(0.4 / fan, rel=0.03)
    if distribution == "truncated_normal":
        assert float(weight.abs().max()) <= 2 * math.sqrt(0.4 / fan) / 0.87962566103423978 + 1e-6


def test_neox_variance_scaling_file_builds_its_initializers():
    spec = JobSpec.from_yaml((CORPUS / "gptj/params_v1/r1.7.0_params_gpt_neox_20B.yaml").read_text())
    assert spec.model.initializer["name"] == "variance_scaling"
    config = replace(model_config(spec, *planned_shapes(spec)), hidden_size=64, num_heads=4, rotary_dim=8,
                     num_hidden_layers=1, filter_size=64, vocab_size=300, max_position_embeddings=16)
    torch.manual_seed(0)
    model = build_model(config, seed=0)
    weight = model.transformer_decoder.layers[0].self_attn.proj_q_dense_layer.weight
    assert float(weight.detach().var()) == pytest.approx(0.4 / 64, rel=0.1)  # scale 0.4, fan_in


# ----------------------------------------------------------------------------- published sizes
# One file per family and the published size of that model (Hugging Face model cards / configs;
# GPT-J's card counts 6,053,381,344 with its 50,400-token vocabulary, the file has 50,257).
PUBLISHED = {
    "gptj/trainer/r2.5.0_params_gptj_6B.yaml": (6_053_381_344, None),
    "gptj/trainer/r2.4.0_params_gpt_neox_20B.yaml": (20_554_567_680, None),
    "falcon/trainer/r2.5.0_params_falcon_7b.yaml": (6_921_720_704, None),
    "starcoder/trainer/r2.5.0_params_starcoder_15b.yaml": (15_517_462_528, None),
    "mpt/params_v2/r2.2.0_params_mpt_7B.yaml": (6_649_286_656, None),
    "gemma2/trainer/r2.5.0_params_gemma2_9b_msl8k.yaml": (9_241_705_984, None),
    "mixtral/trainer/r2.5.0_params_mixtral_8x7b.yaml": (46_702_792_704, 12_879_925_248),
}


@pytest.mark.parametrize("path", PUBLISHED)
def test_published_parameter_counts_within_a_tenth_of_a_percent(path):
    total, active = PUBLISHED[path]
    spec = JobSpec.from_yaml((CORPUS / path).read_text())
    model = build_model(model_config(spec, *planned_shapes(spec)), seed=0, device="meta")
    assert model.num_parameters() == pytest.approx(total, rel=1e-3)
    assert model.num_active_parameters() == pytest.approx(active or total, rel=1e-3)


def test_plan_counts_the_flops_of_the_experts_each_token_visits():
    spec = JobSpec.model_validate({"model": {"preset": "tiny", "moe": {"num_experts": 4, "top_k": 2}},
                                   "train_input": {"batch_size": 2, "max_sequence_length": 16}})
    plan = plan_report(plan_job(spec, 1))
    layers, width, ffn, vocab, seq = 2, 64, 160, 256, 16
    per_layer = 4 * width * width + 4 * width + 2 * 3 * width * ffn  # q, k, v, out; router; 2 of 4 SwiGLU experts
    attention = layers * 2 * 2 * seq * width
    assert plan["flops_per_token"]["dense_forward"] == 2 * (layers * per_layer + vocab * width) + attention
    assert plan["model"]["active_parameters"] == plan["model"]["parameters"] - layers * 2 * 3 * width * ffn
    assert "4 experts, top 2" in plan_table(plan)
    # Gemma-2's window on every other layer bounds the scores of those layers only.
    windowed = JobSpec.model_validate({"model": {"preset": "tiny", "attention_sliding_window_length": 4,
                                                 "sliding_window_every_other_decoder_layer": True},
                                       "train_input": {"batch_size": 2, "max_sequence_length": 16}})
    dense = JobSpec.model_validate({"model": {"preset": "tiny"},
                                    "train_input": {"batch_size": 2, "max_sequence_length": 16}})
    flops = {name: plan_report(plan_job(spec, 1))["flops_per_token"]["dense_forward"]
             for name, spec in (("dense", dense), ("windowed", windowed))}
    saved = flops["dense"] - flops["windowed"]
    assert saved == 2 * 2 * (seq - 4) * width  # layer 1 scores 4 keys instead of 16


@pytest.mark.parametrize(("implementation", "routed_rows"), [("optimized", 2 * 3), ("experimental", 2 * 4 * 3)])
def test_plan_and_training_project_the_cs2_step_of_the_experts_each_token_visits(implementation, routed_rows):
    """docs/design.md §3's step, written out for a dense MoE (4 experts, top 2) on one system, its
    experts apart or fused: a routed expert computes on half the tokens but streams all its weights; the training loop's
    projection of the built model agrees with the plan's. 4M tokens a step make the experts
    compute-bound, so counting all the tokens would cost a third more."""
    from service.full_size import full_size_layers
    from simulator.cost_model import WaferScaleCluster
    from training.perf import project

    tokens, seq, width = 2 ** 22, 16, 64
    params = {"model": {"preset": "tiny", "moe": {"num_experts": 4, "top_k": 2, "moe_implementation": implementation}},
              "train_input": {"batch_size": tokens // seq, "max_sequence_length": seq}}
    spec = JobSpec.model_validate(params)
    plan = plan_report(plan_job(spec, 1))
    cluster = WaferScaleCluster(1)
    rate, knobs = cluster.knobs.efficiency * cluster.system.peak_flop_per_s, cluster.knobs

    def layer_s(weights: int, share: float, streams: bool) -> float:
        compute = 6 * weights * share * tokens / rate + knobs.layer_overhead_s
        return max(compute, (2 * 2 * weights + 2 * weights) / cluster.system.io_bytes_per_s if streams else 0.0)

    # 2 layers x SwiGLU's 3 matrices, of each expert or of all of them fused
    routed = [re.search(r"\.experts\.(experts\.[0-3]|fused_ffns)\.", layer["name"]) is not None
              for layer in plan["layers"]]
    assert sum(routed) == routed_rows
    expected_s = sum(layer_s(layer["numel"], 2 / 4 if is_routed else 1.0, True)
                     for layer, is_routed in zip(plan["layers"], routed))
    expected_s += 2 * layer_s(2 * seq * width, 1.0, False)  # each layer's QKᵀ and AV
    expected_s += knobs.bubble_s + knobs.sync_s  # one system: no SwarmX level
    assert plan["projection"]["sim_step_ms"] == pytest.approx(expected_s * 1e3)
    model = build_model(model_config(spec, *planned_shapes(spec)), seed=0)
    trained = project(model, seq_len=seq, global_tokens=tokens, num_csx=1)
    assert trained.step_ms == pytest.approx(expected_s * 1e3)
    # A study's full-size projection takes the same shares from the plan.
    full_size, _, _ = full_size_layers(params)
    assert [layer.token_share for layer in full_size if layer.streams_weights] == [0.5 if r else 1.0 for r in routed]
