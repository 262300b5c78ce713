"""A job's plan (issue 43 item 1): made once where the spec is admitted, its rules checked there
once, and what the runner, the workers and the loop read instead of the spec."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from csx_config import MAX_CSX, JobSpec, batch_split_problem
from training.plan import JobPlan, plan_job

SPEC = """
train_input: {batch_size: 8, max_sequence_length: 16}
eval_input: {batch_size: 4}
model: {preset: tiny}
sparsity: {algorithm: set, sparsity: 0.5, update: {freq: 2}}
runconfig: {max_steps: 4, seed: 7, num_csx: 2, max_failures: 1, mlflow_experiment: mine}
"""


def test_an_eval_batch_that_cannot_split_is_refused_at_admission():
    """Before the plan a 3-system job with an eval batch of 4 reached its workers and failed
    there; now its plan refuses it, naming the section."""
    spec = JobSpec.from_yaml(SPEC.replace("num_csx: 2", "num_csx: 1"))
    with pytest.raises(ValueError, match=r"eval_input\.batch_size \(4\) must divide evenly over num_csx \(3\)"):
        plan_job(spec.model_copy(update={"train_input": spec.train_input.model_copy(update={"batch_size": 9})}), 3)


@pytest.mark.parametrize("num_csx", [0, MAX_CSX + 1, True, 1.0])
def test_the_number_of_systems_is_checked_once_by_the_plan(num_csx):
    with pytest.raises(ValueError, match=rf"num_csx must be an integer in \[1, {MAX_CSX}\]"):
        plan_job(JobSpec.from_yaml("train_input: {batch_size: 1}"), num_csx)


@settings(max_examples=60)
@given(batch=st.integers(1, 64), num_csx=st.integers(1, 16))
def test_the_schema_the_service_and_the_plan_apply_one_batch_rule(batch, num_csx):
    """The same answer and the same words wherever a job is checked."""
    problem = batch_split_problem(batch, num_csx)
    assert (problem is None) == (batch % num_csx == 0)
    params = {"train_input": {"batch_size": batch}, "eval_input": {"batch_size": num_csx},
              "runconfig": {"num_csx": num_csx}}
    try:
        JobSpec.model_validate(params)
        schema = None
    except ValueError as err:
        schema = str(err)
    try:
        plan_job(JobSpec.model_validate({**params, "runconfig": {}}), num_csx)
        planned = None
    except ValueError as err:
        planned = str(err)
    assert (schema is None) == (planned is None) == (problem is None)
    if problem is not None:
        assert problem in schema and planned == problem


def test_the_plan_records_the_job_as_admitted():
    """The systems and experiment a job is admitted with are what its checkpoints, params.yaml
    and MLflow run record; the runner's options come from the plan."""
    plan = plan_job(JobSpec.from_yaml(SPEC), 4, experiment="alice/exp", max_failures=0)
    assert isinstance(plan, JobPlan)
    assert plan.num_csx == 4 and plan.batch_per_csx == 2 and plan.max_failures == 0
    assert plan.experiment == "alice/exp" and plan.seed == 7
    recorded = yaml.safe_load(plan.loop.params_yaml)["runconfig"]
    assert recorded["num_csx"] == plan.loop.spec_json["runconfig"]["num_csx"] == 4
    assert recorded["mlflow_experiment"] == "alice/exp"
    assert plan.sparsity == {"seed": 7, "algorithm": "set", "sparsity": 0.5, "update": {"freq": 2}}
    assert plan.loop.sparsity_section == {"algorithm": "set", "sparsity": 0.5, "update": {"freq": 2}}
    default = plan_job(JobSpec.from_yaml(SPEC))
    assert (default.num_csx, default.max_failures, default.experiment) == (2, 1, "mine")


def test_the_plan_resolves_what_the_loop_reads():
    plan = plan_job(JobSpec.from_yaml(SPEC))
    assert plan.model.hidden_size == 64 and plan.model.vocab_size == 256  # tiny preset, bytes
    assert plan.data.train.shuffle_seed == 7 and plan.data.eval.data_dirs == ("builtin:shakespeare",)
    assert plan.data.seq_len == 16 and plan.loop.global_batch_size == 8
    with pytest.raises(ValueError, match=r"sequence length \(200\) exceeds model.max_position_embeddings \(128\)"):
        plan_job(JobSpec.from_yaml(SPEC.replace("max_sequence_length: 16", "max_sequence_length: 200")))


@settings(max_examples=25)
@given(specs=st.lists(st.tuples(st.sampled_from(["set", "rigl"]), st.sampled_from([0.5, 0.75, 0.9]),
                                st.sampled_from([1, 2]), st.sampled_from([2, 4])), min_size=2, max_size=6))
def test_a_remembered_report_is_the_report_of_its_plan(specs):
    """plan_report keeps recent reports: whatever plans came before, each answer is the one its
    own plan gives when reported afresh, and a caller changing its copy changes no later answer."""
    from training import report as reports

    for algorithm, level, num_csx, freq in specs + specs[::-1]:
        text = (SPEC.replace("algorithm: set", f"algorithm: {algorithm}").replace("sparsity: 0.5", f"sparsity: {level}")
                .replace("freq: 2", f"freq: {freq}"))
        plan = plan_job(JobSpec.from_yaml(text), num_csx)
        answer, afresh = reports.plan_report(plan), reports._report(plan)
        afresh["memory"]["available"] = answer["memory"]["available"]  # the free memory, read each time
        assert answer == afresh
        answer["layers"].clear()
        answer["memory"]["per_worker"].clear()
