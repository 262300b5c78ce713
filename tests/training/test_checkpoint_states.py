"""ModelZoo's checkpoint-loading keys, applied as its trainer applies them (issue 44 item 3):
``load_checkpoint_states`` (``model``: a fine-tuning start from the weights at step 0; any
list of states), ``disable_strict_checkpoint_loading`` (a checkpoint of another model loads
what fits) and ``save_initial_checkpoint`` (the state training starts from, before step 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from csx_config import JobSpec
from training.checkpoint import checkpoint_path, load_checkpoint
from training.loop import train
from training.plan import JobPlan, plan_job
from training_helpers import same_state

torch.set_num_threads(1)
SPEC = """
train_input: {batch_size: 4, max_sequence_length: 16}
eval_input: {batch_size: 4, max_sequence_length: 16}
model: {preset: tiny, dropout_rate: 0.1}
optimizer: {optimizer_type: AdamW, learning_rate: [{scheduler: Linear, initial_learning_rate: 0.0, end_learning_rate: 1.0e-3, total_iters: 6}]}
sparsity: {algorithm: set, sparsity: 0.5, update: {freq: 2}, drop_fraction: 0.3}
runconfig: {max_steps: 3, log_steps: 3, eval_steps: 1, seed: 0, mlflow_experiment: "", sparse_kernel: dense}
"""
WEIGHT = "transformer_decoder.layers.0.ffn.ffn.0.linear_layer.weight"


def spec(**runconfig) -> JobPlan:
    base = JobSpec.from_yaml(SPEC)
    return plan_job(base.model_copy(update={"runconfig": base.runconfig.model_copy(update=runconfig)}))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A sparse run's checkpoint at step 3 (every state)."""
    model_dir = tmp_path_factory.mktemp("pretrained")
    train(spec(), model_dir=str(model_dir))
    return checkpoint_path(model_dir, 3)


def test_model_only_starts_from_the_weights_at_step_zero(pretrained, tmp_path):
    """A fine-tuning file's `load_checkpoint_states: model`: the weights (and masks) of the
    checkpoint, then max_steps steps from step 0 with every other state (optimizer, LR
    schedule, sparsity state, data position, RNG) as a fresh run starts with it."""
    summary = train(spec(checkpoint_path=str(pretrained), load_checkpoint_states="model",
                         save_initial_checkpoint=True), model_dir=str(tmp_path / "tuned"))
    assert [step for step, _ in summary["train_losses"]] == [1, 2, 3]
    tuned = load_checkpoint(checkpoint_path(tmp_path / "tuned", 0))
    assert same_state(tuned["model"], load_checkpoint(pretrained)["model"])  # the weights, as saved
    train(spec(save_initial_checkpoint=True), model_dir=str(tmp_path / "fresh"))
    fresh = load_checkpoint(checkpoint_path(tmp_path / "fresh", 0))
    for key in ("optimizer", "lr_scheduler", "sparsity", "data_position", "rng", "step", "phase_start"):
        assert same_state(tuned[key], fresh[key]), key
    assert not same_state(tuned["model"], fresh["model"])


def test_all_states_resume_at_the_checkpoint_step(pretrained, tmp_path):
    summary = train(spec(checkpoint_path=str(pretrained), max_steps=6), model_dir=str(tmp_path / "all"))
    assert [step for step, _ in summary["train_losses"]] == [4, 5, 6]


def test_states_but_the_data_position_keep_the_step_and_optimizer(pretrained, tmp_path):
    """ModelZoo's README: `model,optimizer,global_step,lr_scheduler` loads everything but the
    dataloader: the step and optimizer moments carry on, the data starts from its first batch."""
    summary = train(spec(checkpoint_path=str(pretrained), max_steps=6,
                         load_checkpoint_states="model,optimizer,global_step,lr_scheduler,sparsity"),
                    model_dir=str(tmp_path / "no_data"))
    assert [step for step, _ in summary["train_losses"]] == [4, 5, 6]
    state = load_checkpoint(checkpoint_path(tmp_path / "no_data", 6))
    assert state["data_position"] == {"position": 3}  # batches 0-2, not 3-5
    assert state["optimizer"]["state"][0]["step"].item() == 6  # moments carried on from step 3


def test_a_state_the_checkpoint_lacks_is_refused_naming_what_it_holds(pretrained, tmp_path):
    finalized = tmp_path / "final.mdl"
    torch.save({"model": load_checkpoint(pretrained)["model"]}, finalized)
    with pytest.raises(ValueError, match=r"names \['optimizer'\], which checkpoint .* holds \['model'\]"):
        train(spec(checkpoint_path=str(finalized), load_checkpoint_states=["model", "optimizer"]),
              model_dir=str(tmp_path / "run"))


def test_an_unknown_state_name_is_refused_by_the_schema():
    with pytest.raises(ValueError, match="(?s)runconfig.load_checkpoint_states.*'modle'"):
        JobSpec.model_validate({"runconfig": {"load_checkpoint_states": "modle,optimizer"}})


def test_strict_loading_refuses_another_model_and_disabled_loads_what_fits(pretrained, tmp_path):
    """A checkpoint with a tensor the model lacks and one missing: refused by default; with
    disable_strict_checkpoint_loading the rest loads and the missing one keeps its init."""
    state = load_checkpoint(pretrained)
    weights = dict(state["model"])
    missing = "transformer_decoder.layers.1.norm1.weight"
    del weights[missing]
    weights["extra_head.weight"] = torch.zeros(2, 2)
    odd = tmp_path / "odd.mdl"
    torch.save({**state, "model": weights}, odd)
    with pytest.raises(ValueError, match="does not fit the model"):
        train(spec(checkpoint_path=str(odd)), model_dir=str(tmp_path / "strict"))
    train(spec(checkpoint_path=str(odd), load_checkpoint_states="model", disable_strict_checkpoint_loading=True,
               save_initial_checkpoint=True), model_dir=str(tmp_path / "lenient"))
    initial = load_checkpoint(checkpoint_path(tmp_path / "lenient", 0))["model"]
    assert torch.equal(initial[WEIGHT], weights[WEIGHT]) and "extra_head.weight" not in initial
    assert torch.equal(initial[missing], torch.ones_like(initial[missing]))  # a norm's initial weight


def test_save_initial_checkpoint_writes_step_zero_once(tmp_path):
    first = train(spec(save_initial_checkpoint=True), model_dir=str(tmp_path))
    assert first["initial_checkpoint"] == str(checkpoint_path(tmp_path, 0))
    assert load_checkpoint(checkpoint_path(tmp_path, 0))["step"] == 0
    again = train(spec(save_initial_checkpoint=True, max_steps=6), model_dir=str(tmp_path))
    assert "initial_checkpoint" not in again  # resumed at step 3, whose checkpoint exists
