"""MoE parameters named as the file's ModelZoo release names them (issue 44 item 2): the fused
experts of the ``optimized`` implementation (the default up to 2.5; MoE params-layout files are
2.3's), an expert each with the shared ones apart for ``experimental`` (the default from 2.6;
trainer-layout files run on 2.10), and ``functional``; the same function and parameter count in
each; published files validated against ModelZoo's own names with the right sparsified counts;
a filter pattern that matches nothing warns naming it, a group that matches nothing is refused."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from csx_config import JobSpec
from models.config import ModelConfig
from models.transformer import build_model
from training.build import build_sparse_model
from training.plan import model_config
from training.data import planned_shapes
from training.loop import expert_sparsity_metrics, train
from training.plan import plan_job
from training.report import plan_report

torch.set_num_threads(1)
CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "modelzoo_corpus"
TINY = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, filter_size=48,
                   max_position_embeddings=16)
IMPLEMENTATIONS = ("optimized", "experimental", "functional")


# ModelZoo's parameter names of one decoder layer's MoE block, written from its source
# (src/cerebras/modelzoo/layers/SparseMoEBlock.py and FeedForwardNetwork.py, Release_2.5.0 and
# Release_2.10.0; TopKExpertsSparseLinear holds expert_weights (out, experts, in) and, with
# biases, expert_biases (out, experts, 1) from 2.5): the block is the layer's `ffn`, its router
# `gate`, its experts `experts`; {e} a routed expert, {s} a shared one, {i} the FFN layer.
MODELZOO_NAMES = {
    "optimized": ["ffn.gate.weight", "ffn.experts.fused_ffns.{i}.linear_layer.expert_weights",
                  "ffn.experts.fused_ffns.0.linear_layer_for_glu.expert_weights",
                  "ffn.experts.fused_ffns.{i}.linear_layer.expert_biases",
                  "ffn.experts.fused_ffns.0.linear_layer_for_glu.expert_biases"],
    "experimental": ["ffn.gate.weight", "ffn.experts.experts.{e}.{i}.linear_layer.weight",
                     "ffn.experts.experts.{e}.0.linear_layer_for_glu.weight",
                     "ffn.experts.experts.{e}.{i}.linear_layer.bias",
                     "ffn.experts.experts.{e}.0.linear_layer_for_glu.bias",
                     "ffn.experts.shared_experts.{s}.ffn.{i}.linear_layer.weight",
                     "ffn.experts.shared_experts.{s}.ffn.0.linear_layer_for_glu.weight",
                     "ffn.experts.shared_experts.{s}.ffn.{i}.linear_layer.bias",
                     "ffn.experts.shared_experts.{s}.ffn.0.linear_layer_for_glu.bias"],
    "functional": ["ffn.gate.weight", "ffn.experts.experts.{a}.ffn.{i}.linear_layer.weight",  # {a}: every expert
                   "ffn.experts.experts.{a}.ffn.0.linear_layer_for_glu.weight",
                   "ffn.experts.experts.{a}.ffn.{i}.linear_layer.bias",
                   "ffn.experts.experts.{a}.ffn.0.linear_layer_for_glu.bias"],
}


def modelzoo_names(config: ModelConfig) -> set[str]:
    """Every MoE parameter name ModelZoo gives a model of ``config``, from the templates."""
    moe, glu, bias = config.moe, config.is_glu, config.use_ffn_bias
    routed, shared = moe["num_experts"], moe.get("num_shared_experts") or 0
    ranges = {"e": range(routed), "s": range(shared), "a": range(routed + shared), "i": range(2)}
    names = set()
    for template in MODELZOO_NAMES[moe["moe_implementation"]]:
        if ("_for_glu" in template and not glu) or ("bias" in template and not bias):
            continue
        fields = [field for field in ranges if "{" + field + "}" in template]
        for layer in range(config.num_hidden_layers):
            for values in itertools.product(*(ranges[field] for field in fields)):
                names.add(f"transformer_decoder.layers.{layer}." + template.format(**dict(zip(fields, values))))
    return names


def moe_names(model) -> set[str]:
    return {name for name, _ in model.named_parameters() if ".ffn." in name}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("shared", "nonlinearity", "bias"), [(0, "swiglu", False), (1, "swiglu", True),
                                                              (2, "gelu", True)])
def test_each_layout_has_modelzoos_names(implementation, shared, nonlinearity, bias):
    config = replace(TINY, nonlinearity=nonlinearity, use_ffn_bias=bias,
                     moe={"num_experts": 4, "top_k": 2, "num_shared_experts": shared or None,
                          "moe_implementation": implementation})
    assert moe_names(build_model(config, seed=0, device="meta")) == modelzoo_names(config)


LINEARS = ("linear_layer", "linear_layer_for_glu")


def expert_layers(model, layer: int) -> list[list[dict]]:
    """Per expert of a decoder layer (routed, then shared): its two FFN layers' weights and
    biases as {linear name: (weight, bias)}, views into the model's parameters."""
    experts = model.transformer_decoder.layers[layer].ffn.experts
    if hasattr(experts, "fused_ffns"):
        count = experts.fused_ffns[0].linear_layer.experts
        return [[{name: (getattr(ffn, name).expert_weights[:, e], getattr(ffn, name).expert_biases[:, e, 0])
                  for name in LINEARS if hasattr(ffn, name)} for ffn in experts.fused_ffns] for e in range(count)]
    if hasattr(experts, "shared_experts"):
        ffns = [list(layers) for layers in experts.experts] + [list(shared.ffn) for shared in experts.shared_experts]
    else:
        ffns = [list(expert.ffn) for expert in experts.experts]
    return [[{name: (getattr(ffn, name).weight, getattr(ffn, name).bias) for name in LINEARS if hasattr(ffn, name)}
             for ffn in expert] for expert in ffns]


def copy_weights(source, target) -> None:
    """Every weight of one layout into a model of another, expert by expert."""
    with torch.no_grad():
        target.load_state_dict({k: v for k, v in source.state_dict().items() if ".ffn.experts." not in k}, strict=False)
        for layer in range(len(source.transformer_decoder.layers)):
            for expert, into in zip(expert_layers(source, layer), expert_layers(target, layer), strict=True):
                for ffn, ffn_into in zip(expert, into, strict=True):
                    for name, (weight, bias) in ffn.items():
                        ffn_into[name][0].copy_(weight)
                        ffn_into[name][1].copy_(bias)


def test_the_three_layouts_compute_the_same_function_with_the_same_parameter_count():
    moe = {"num_experts": 4, "top_k": 2, "num_shared_experts": 1, "null_expert_bias": 0.1}
    models = {impl: build_model(replace(TINY, use_ffn_bias=True, moe={**moe, "moe_implementation": impl}), seed=0)
              for impl in IMPLEMENTATIONS}
    for impl in ("experimental", "functional"):
        copy_weights(models["optimized"], models[impl])
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        outputs = {impl: model(ids, ids) for impl, model in models.items()}
    for impl in ("experimental", "functional"):
        assert torch.allclose(outputs[impl][0], outputs["optimized"][0], atol=1e-5)
        assert torch.allclose(outputs[impl][1], outputs["optimized"][1], atol=1e-6)
    assert len({model.num_parameters() for model in models.values()}) == 1
    assert len({model.num_active_parameters() for model in models.values()}) == 1


# ----------------------------------------------------------------------------- published files
def published(path: str, overrides: list[str] | None = None, **sparsity) -> JobSpec:
    params = yaml.safe_load((CORPUS / path).read_text())
    spec = JobSpec.from_yaml(yaml.safe_dump(params), overrides)
    if sparsity:
        spec = spec.model_copy(update={"sparsity": {**spec.sparsity, **sparsity}})
    return spec


def sparsified(spec: JobSpec) -> int:
    return sum(layer["sparse"] for layer in plan_report(plan_job(spec, 1))["layers"])


MIXTRAL_23 = "mixtral/params_v2/r2.3.0_params_mixtral_8x22b.yaml"  # 2.3's file (params layout)
MIXTRAL_8X7B_23 = "mixtral/params_v2/r2.3.0_params_mixtral_8x7b.yaml"
MOE_111M_SHARED = "mixtral/trainer/r2.5.0_params_moe_111M_with_shared_expert.yaml"  # the 2.5 to 2.10 file
MIXTRAL_TRAINER = "mixtral/trainer/r2.5.0_params_mixtral_8x7b.yaml"
ATTENTION = ["*proj_[qkv]_dense_layer.weight", "*proj_output_dense_layer.weight"]


@pytest.mark.parametrize(("path", "overrides", "implementation", "parameters"), [
    (MIXTRAL_23, None, "optimized", 140_620_634_112),  # Mixtral 8x22B: 141B (Mistral AI)
    (MIXTRAL_8X7B_23, None, "optimized", 46_702_792_704),  # Mixtral 8x7B: 46.7B (Mistral AI)
    (MIXTRAL_TRAINER, None, "experimental", 46_702_792_704),
    (MOE_111M_SHARED, None, "experimental", None),
    (MOE_111M_SHARED, ["model.moe.moe_implementation=optimized"], "optimized", None),  # as 2.5 built it
])
def test_published_moe_files_take_their_releases_names_and_counts(path, overrides, implementation, parameters):
    spec = published(path, overrides)
    assert spec.model.moe.moe_implementation == implementation
    config = model_config(spec, *planned_shapes(spec))
    model = build_model(config, seed=0, device="meta")
    assert moe_names(model) == modelzoo_names(config)
    functional = build_model(replace(config, moe={**config.moe, "moe_implementation": "functional"}),
                             seed=0, device="meta")
    assert model.num_parameters() == functional.num_parameters() == (parameters or model.num_parameters())


def test_the_2_3_mixtral_file_sparsifies_what_a_cs2_sparsifies():
    """Its '*linear_layer.weight' filter matches no expert of 2.3's fused layout: the attention
    alone, 4 x 56 matrices (1,120 when the experts were named functionally); 2.3's own pattern
    selects the fused experts, with no warning."""
    assert sparsified(published(MIXTRAL_23, param_filter=[*ATTENTION, "*linear_layer.weight"])) == 4 * 56
    fused = published(MIXTRAL_23, param_filter=[*ATTENTION, "*linear_layer.expert_weights"])
    assert sparsified(fused) == (4 + 2) * 56 and plan_report(plan_job(fused, 1))["warnings"] == []
    functional = published(MIXTRAL_23, ["model.moe.moe_implementation=functional"],
                           param_filter=[*ATTENTION, "*linear_layer.weight"])
    assert sparsified(functional) == (4 + 8 * 2) * 56


def test_routed_and_shared_experts_are_apart_from_2_6():
    routed = published(MOE_111M_SHARED, param_filter=["*experts.experts.*linear_layer.weight"])
    assert sparsified(routed) == 10 * 4 * 2  # 10 layers x 4 routed experts x 2 (100 if the shared one counted)
    shared = published(MOE_111M_SHARED, param_filter=["*shared_experts*linear_layer.weight"])
    assert sparsified(shared) == 10 * 1 * 2


def test_a_pattern_that_matches_nothing_warns_naming_it_and_a_group_that_matches_nothing_is_refused(tmp_path):
    spec = published(MIXTRAL_23, param_filter=[*ATTENTION, "*shared_experts*"])
    plan = plan_report(plan_job(spec, 1))
    assert plan["warnings"] == [
        "sparsity.param_filter: pattern '*shared_experts*' matches no parameter of this model, so it selects "
        "nothing (the parameter names: csx run --validate_only --logging DEBUG)"]
    groups = published(MIXTRAL_23).model_copy(update={"sparsity": [
        {"algorithm": "static", "sparsity": 0.5, "param_filter": ATTENTION},
        {"algorithm": "static", "sparsity": 0.5, "param_name_patterns": "expert_weights$"},
        {"algorithm": "static", "sparsity": 0.5, "param_filter": "*linear_layer.weight"}]})
    with pytest.raises(ValueError, match="sparsity group 2 .* matches no parameter"):
        plan_report(plan_job(groups, 1))
    tiny = JobSpec.model_validate({"model": {"preset": "tiny"}, "train_input": {"batch_size": 2, "max_sequence_length": 8},
                                   "runconfig": {"max_steps": 1, "mlflow_experiment": "", "sparse_kernel": "dense"},
                                   "sparsity": {"algorithm": "static", "sparsity": 0.5,
                                                "param_name_patterns": ["proj_q", "expert_weights"]}})
    summary = train(plan_job(tiny), model_dir=str(tmp_path / "warned"))
    assert any("pattern 'expert_weights' matches no parameter" in warning for warning in summary["warnings"])
    empty = tiny.model_copy(update={"sparsity": {"algorithm": "static", "sparsity": 0.5,
                                                 "param_filter": "*linear_layer.expert_weights"}})
    with pytest.raises(ValueError, match="sparsity group 0 .* matches no parameter"):  # training, not only the plan
        train(plan_job(empty), model_dir=str(tmp_path / "refused"))


def test_the_layout_default_is_the_releases_and_survives_a_conversion():
    params = published(MIXTRAL_23)
    assert params.model.moe.moe_implementation == "optimized"
    trainer, _ = params.to_layout("trainer")
    assert trainer["trainer"]["init"]["model"]["moe"]["moe_implementation"] == "optimized"
    assert JobSpec.model_validate(trainer).model.moe.moe_implementation == "optimized"
    file = yaml.safe_load((CORPUS / MIXTRAL_TRAINER).read_text())
    assert JobSpec.model_validate(file).model.moe.moe_implementation == "experimental"
    assert JobSpec.from_yaml(yaml.safe_dump(file), ["model.num_hidden_layers=1"]).model.moe.moe_implementation \
        == "experimental"  # an override reads the file in its own layout
    back, _ = JobSpec.model_validate(file).to_layout("params")
    assert JobSpec.model_validate(back).model.moe.moe_implementation == "experimental"


def test_fused_experts_train_sparse_with_each_experts_sparsity(tmp_path):
    """A fused proxy with RigL on '*linear_layer.expert_weights': every fused tensor at the
    target, RigL keeping its count, and each expert's slice reported."""
    spec = JobSpec.model_validate({
        "model": {"preset": "tiny", "moe": {"num_experts": 4, "top_k": 2, "moe_implementation": "optimized"}},
        "train_input": {"batch_size": 4, "max_sequence_length": 16},
        "sparsity": {"algorithm": "rigl", "sparsity": 0.75, "update": {"freq": 2},
                     "param_filter": ["*linear_layer.expert_weights"]},
        "runconfig": {"max_steps": 4, "log_steps": 2, "mlflow_experiment": "", "sparse_kernel": "dense"}})
    summary = train(plan_job(spec), model_dir=str(tmp_path))
    density = summary["layer_density"]
    assert sorted(density) == [f"transformer_decoder.layers.{layer}.ffn.experts.fused_ffns.{i}.linear_layer.expert_weights"
                               for layer in range(2) for i in range(2)]
    assert all(value == pytest.approx(0.25, abs=1e-3) for value in density.values())
    hashes = [digest for _, digest in summary["mask_hashes"]]
    assert len(set(hashes)) == len(hashes) == 3  # start, steps 2 and 4: RigL moved the masks
    model, alg = build_sparse_model(model_config(spec, *planned_shapes(spec)), spec.sparsity, seed=0)
    metrics = expert_sparsity_metrics(alg, model)
    assert sorted(metrics) == [f"experts/sparsity/L{layer:02d}.expert{e}" for layer in range(2) for e in range(4)]
    total = sum(mask.sum() for _, _, mask in alg.sparse_parameters()) / sum(m.numel() for _, _, m in alg.sparse_parameters())
    assert sum(1 - v for v in metrics.values()) / len(metrics) == pytest.approx(float(total), abs=1e-6)
