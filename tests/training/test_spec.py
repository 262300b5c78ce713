"""JobSpec: ModelZoo's params schema, unknown keys named with a suggestion, hardware-only keys
listed, LR schedulers, --set overrides, no torch import."""

import math
import subprocess
import sys

import pytest
from pydantic import ValidationError

from csx_config import JobSpec, with_overrides
from csx_config.schedulers import SchedulerSpec, learning_rate_at, warmup_steps


def _error_locations(text):
    with pytest.raises(ValidationError) as info:
        JobSpec.from_yaml(text)
    return [".".join(map(str, e["loc"])) for e in info.value.errors()]


def test_defaults_and_full_layout():
    spec = JobSpec.from_yaml("""
train_input: {data_dir: [/data/a, /data/b], batch_size: 8, max_sequence_length: 32, shuffle: false, num_workers: 4}
eval_input: {batch_size: 4, max_sequence_length: 32}
model: {preset: mini, filter_size: 256, tokenizer: byte, mixed_precision: true}
optimizer: {optimizer_type: SGD, learning_rate: 0.1, momentum: 0.9, weight_decay_rate: 0.01}
sparsity: [{param_filter: "*ffn*", algorithm: set, sparsity: 0.9, update: {freq: 10}}]
runconfig: {max_steps: 50, num_csx: 4, eval_frequency: 10, save_checkpoint_steps: 25, use_cs_grad_accum: true}
""")
    assert spec.train_input.batch_size == 8 and spec.eval_data_dirs() == ["/data/a", "/data/b"]
    assert spec.optimizer.extra_kwargs() == {"momentum": 0.9} and spec.optimizer.weight_decay == 0.01
    assert spec.runconfig.checkpoint_steps == 25
    resolved = spec.model.resolved()  # file > preset > ModelZoo default
    assert resolved["filter_size"] == 256 and resolved["hidden_size"] == 128
    assert resolved["nonlinearity"] == "swiglu" and resolved["layer_norm_epsilon"] == 1e-5
    assert spec.not_applied() == ["train_input.num_workers", "model.mixed_precision",
                                  "runconfig.use_cs_grad_accum"]
    assert JobSpec.from_yaml(spec.to_yaml()) == spec
    assert JobSpec.from_yaml("") == JobSpec()


@pytest.mark.parametrize("text, location", [
    ("train_input: {batch_size: 0}", "train_input.batch_size"),
    ("model: {preset: huge}", "model.preset"),
    ("model: {nonlinearity: swishy}", "model.nonlinearity"),
    ("model: {norm_type: batchnorm}", "model.norm_type"),
    ("model: {position_embedding_type: relative}", "model.position_embedding_type"),
    ("model: {sparse_wide_sparsity: 1.0}", "model.sparse_wide_sparsity"),
    ("optimizer: {weight_decay: .nan}", "optimizer.weight_decay"),
    ("optimizer: {max_gradient_norm: -1}", "optimizer.max_gradient_norm"),
    ("runconfig: {num_csx: 193}", "runconfig.num_csx"),
    ("sparsity: 1.0", "sparsity"),
])
def test_bad_fields_are_named(text, location):
    assert location in _error_locations(text)


@pytest.mark.parametrize("text, message", [
    ("model: {hiden_size: 3}", "model.hiden_size is not a key of model.*did you mean 'hidden_size'"),
    ("runconfig: {max_step: 3}", "did you mean 'max_steps'"),
    ("train_input: {batch_sz: 3}", "did you mean 'batch_size'"),
    ("optimizer: {optimiser_type: AdamW}", "did you mean 'optimizer_type'"),
    ("sparsty: 0.5", "params.sparsty.*did you mean 'sparsity'"),
    ("model: {nonlinearity: swishy}", "'swiglu'"),  # the choices are listed
    ("runconfig: {checkpoint_steps: 1, save_checkpoint_steps: 2}", "not both"),
])
def test_unknown_keys_and_values_suggest_the_known_ones(text, message):
    with pytest.raises(ValidationError, match=message):
        JobSpec.from_yaml(text)


@pytest.mark.parametrize("sparsity, where", [
    ("{algorithm: rigl, sparsity: 1.2}", "sparsity.sparsity"),
    ("[{param_filter: a, sparsity: .nan}]", "sparsity[0].sparsity"),
    ("{sparsity: {type: cubic, init_sparsity: -0.1, end_sparsity: 0.9}}", "sparsity.sparsity.init_sparsity"),
    ("{sparsity: [0.5, 1.5]}", "sparsity.sparsity[1]"),
    ("{drop_fraction: .nan}", "sparsity.drop_fraction is NaN"),
])
def test_sparsity_levels_checked_with_their_path(sparsity, where):
    with pytest.raises(ValidationError, match=__import__("re").escape(where)):
        JobSpec.from_yaml(f"sparsity: {sparsity}")


def test_both_sparsity_layouts_pass_through_unchanged():
    legacy = {"type": "rigl", "sparsity": 0.8, "param_name_patterns": {".*ffn.*": 0.9, ".*attn.*": 0.5}}
    groups = [{"param_filter": "*proj_q*", "algorithm": "static", "sparsity": 0.5}]
    for section in (legacy, groups):
        assert JobSpec.model_validate({"sparsity": section}).sparsity == section


def test_learning_rate_schedulers_follow_cstorch():
    warmup_cosine = JobSpec.from_yaml("""
optimizer:
  learning_rate:
    - {scheduler: Linear, initial_learning_rate: 0.0, end_learning_rate: 1.0e-3, total_iters: 10}
    - {scheduler: CosineDecayLR, initial_learning_rate: 1.0e-3, end_learning_rate: 1.0e-4, decay_steps: 90}
""").optimizer.learning_rate
    assert [learning_rate_at(warmup_cosine, s) for s in (0, 5, 10)] == pytest.approx([0.0, 5e-4, 1e-3])
    assert learning_rate_at(warmup_cosine, 55) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert learning_rate_at(warmup_cosine, 100) == learning_rate_at(warmup_cosine, 500) == pytest.approx(1e-4)
    assert warmup_steps(warmup_cosine) == 10


@pytest.mark.parametrize("rate", [
    "3.0e-3",
    "{scheduler: Linear, initial_learning_rate: 1.0e-3, end_learning_rate: 0.0, total_iters: 9}",
    "[{scheduler: CosineDecay, initial_learning_rate: 1.0e-3, end_learning_rate: 0.0,"
    " total_iters: 9}]",
])
def test_no_warmup_without_a_rising_first_phase(rate):
    spec = JobSpec.from_yaml(f"optimizer: {{learning_rate: {rate}}}")
    assert warmup_steps(spec.optimizer.learning_rate) == 0
    expo = SchedulerSpec(scheduler="Exponential", initial_learning_rate=1.0, decay_rate=0.5,
                         total_iters=10, staircase=True)
    assert [expo.rate(s) for s in (0, 9, 10, 25)] == [1.0, 1.0, 0.5, 0.25]
    assert SchedulerSpec(scheduler="constant", learning_rate=0.3).rate(1000) == 0.3
    assert SchedulerSpec(scheduler="Step", initial_learning_rate=1.0, step_size=3, gamma=0.1).rate(7) == pytest.approx(0.01)
    poly = SchedulerSpec(scheduler="Polynomial", initial_learning_rate=1.0, end_learning_rate=0.0,
                         total_iters=4, power=2.0)
    assert poly.rate(2) == pytest.approx(0.25)
    inv = SchedulerSpec(scheduler="InverseSquareRootDecay", initial_learning_rate=1.0, warmup_steps=4)
    assert inv.rate(1) == pytest.approx(0.5) and inv.rate(16) == pytest.approx(0.25)
    assert math.isclose(learning_rate_at(2e-3, 123), 2e-3)


@pytest.mark.parametrize("rate, message", [
    ("{scheduler: Cosine, initial_learning_rate: 1.0}", "did you mean 'cosinedecay'"),
    ("{scheduler: Linear, initial_learning_rate: 1.0}", "needs end_learning_rate, total_iters"),
    ("{scheduler: Constant, learning_rate: 1.0, decay_rate: 0.5}", "does not take decay_rate"),
    ("[{scheduler: Constant, learning_rate: 1.0}, {scheduler: Constant, learning_rate: 0.5}]", "needs total_iters"),
    ("-1.0", "must be > 0"),
])
def test_bad_schedulers_are_named(rate, message):
    with pytest.raises(ValidationError, match=message):
        JobSpec.from_yaml(f"optimizer: {{learning_rate: {rate}}}")


def test_overrides_are_typed_by_the_schema():
    spec = JobSpec.from_yaml("model: {hidden_size: 768}\n",
                             ["model.hidden_size=256", "model.num_hidden_layers=2",
                              "runconfig.mlflow_experiment=2024", "train_input.data_dir=[/a, /b]",
                              "optimizer.learning_rate=1.0e-3", "sparsity.update.freq=7"])
    assert spec.model.hidden_size == 256 and spec.model.num_hidden_layers == 2
    assert spec.runconfig.mlflow_experiment == "2024"  # a string field keeps the text
    assert spec.train_input.data_dir == ["/a", "/b"] and spec.optimizer.learning_rate == 1e-3
    assert spec.sparsity == {"update": {"freq": 7}}
    with pytest.raises(ValueError, match="section.key=value"):
        with_overrides({}, ["model.hidden_size"])
    with pytest.raises(ValidationError, match="did you mean 'hidden_size'"):
        JobSpec.from_yaml("", ["model.hidden=3"])
    with pytest.raises(ValidationError, match="model.hidden_size"):
        JobSpec.from_yaml("", ["model.hidden_size=big"])


def test_yaml_errors_are_value_errors():
    with pytest.raises(ValueError, match="does not parse"):
        JobSpec.from_yaml("train_input: {batch_size: 3")
    with pytest.raises(ValueError, match="mapping"):
        JobSpec.from_yaml("- 1\n- 2")
    with pytest.raises(ValueError, match="correct_bias"):
        JobSpec.from_yaml("optimizer: {correct_bias: false}")


def test_importing_the_spec_does_not_load_torch():
    code = "import sys, csx_config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_rest_bodies_take_the_same_overrides():
    from service.schemas import JobCreate

    job = JobCreate.model_validate({"params": {"model": {"hidden_size": 768}},
                                    "overrides": ["model.hidden_size=256", "runconfig.max_steps=7"]})
    assert job.params.model.hidden_size == 256 and job.params.runconfig.max_steps == 7
    with pytest.raises(ValidationError, match="did you mean 'hidden_size'"):
        JobCreate.model_validate({"params": {}, "overrides": ["model.hiden_size=3"]})
    with pytest.raises(ValidationError, match="section.key=value"):
        JobCreate.model_validate({"params": {}, "overrides": ["nonsense"]})
