"""JobSpec: ModelZoo layout, extra keys forbidden, errors naming the field, no torch import."""

import subprocess
import sys

import pytest
from pydantic import ValidationError

from workers.spec import JobSpec, WarmupCosineSpec


def _error_locations(text):
    with pytest.raises(ValidationError) as info:
        JobSpec.from_yaml(text)
    return [".".join(map(str, e["loc"])) for e in info.value.errors()]


def test_defaults_and_full_layout():
    spec = JobSpec.from_yaml("""
train_input: {data_dir: /data/x.txt, batch_size: 8, seq_len: 32, shuffle: false}
eval_input: {batch_size: 4, seq_len: 32}
model: {preset: mini, d_ff: 256, tokenizer: byte}
optimizer: {type: SGD, learning_rate: {type: warmup_cosine, peak: 0.1, warmup_steps: 5}, momentum: 0.9}
sparsity: [{param_filter: "layers.*.mlp.*", algorithm: set, sparsity: 0.9, update: {freq: 10}}]
runconfig: {max_steps: 50, num_csx: 4, eval_frequency: 10}
""")
    assert spec.train_input.batch_size == 8 and spec.eval_data_dir() == "/data/x.txt"
    assert isinstance(spec.optimizer.learning_rate, WarmupCosineSpec)
    assert spec.optimizer.extra_kwargs() == {"momentum": 0.9}
    assert spec.model.size_overrides() == {"d_ff": 256}
    assert JobSpec.from_yaml(spec.to_yaml()) == spec
    assert JobSpec.from_yaml("") == JobSpec()


@pytest.mark.parametrize("text, location", [
    ("train_input: {batch_sz: 3}", "train_input.batch_sz"),
    ("runconfig: {max_step: 3}", "runconfig.max_step"),
    ("bogus_section: {}", "bogus_section"),
    ("train_input: {batch_size: 0}", "train_input.batch_size"),
    ("model: {preset: huge}", "model.preset"),
    ("model: {sparse_wide_sparsity: 1.0}", "model.sparse_wide_sparsity"),
    ("optimizer: {weight_decay: .nan}", "optimizer.weight_decay"),
    ("optimizer: {max_gradient_norm: -1}", "optimizer.max_gradient_norm"),
    ("runconfig: {num_csx: 193}", "runconfig.num_csx"),
    ("sparsity: 1.0", "sparsity"),
])
def test_bad_fields_are_named(text, location):
    assert location in _error_locations(text)


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


def test_yaml_errors_are_value_errors():
    with pytest.raises(ValueError, match="does not parse"):
        JobSpec.from_yaml("train_input: {batch_size: 3")
    with pytest.raises(ValueError, match="mapping"):
        JobSpec.from_yaml("- 1\n- 2")
    with pytest.raises(ValueError, match="minimum"):
        JobSpec.from_yaml("optimizer: {learning_rate: {peak: 0.001, minimum: 0.01}}")
    with pytest.raises(ValueError, match="n_head, d_model, d_ff"):
        JobSpec.from_yaml("model: {preset: null, n_layer: 2}")


def test_importing_the_spec_does_not_load_torch():
    code = "import sys, workers.spec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
