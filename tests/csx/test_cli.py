"""`csx run --validate_only`, `csx run` on one system, `csx finalize` round trip, plan errors."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from csx import cli
from training.checkpoint import load_checkpoint
from training.plan import model_config, plan_job
from models.transformer import build_model
from training.report import plan_report
from csx_config import JobSpec

torch.set_num_threads(1)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUN_SPEC = """
train_input: {batch_size: 4, max_sequence_length: 16}
eval_input: {batch_size: 4, max_sequence_length: 16}
model: {preset: tiny}
sparsity: {algorithm: static, sparsity: 0.75}
runconfig: {max_steps: 4, log_steps: 2, eval_steps: 2, mlflow_experiment: ""}
"""


def test_validate_only_prints_the_plan(capsys):
    assert cli.main(["run", "--params", str(EXAMPLES / "rigl.yaml"), "--validate_only"]) == 0
    out = capsys.readouterr().out
    assert "group 0 rigl: 14 parameters" in out
    assert "transformer_decoder.layers.1.ffn.ffn.1.linear_layer.weight" in out and "projected CS-2 step" in out
    assert "matched" not in out
    cli.main(["run", "--params", str(EXAMPLES / "rigl.yaml"), "--validate_only", "--logging", "DEBUG"])
    debug = capsys.readouterr().out
    assert "matched transformer_decoder.layers.0.self_attn.proj_q_dense_layer.weight" in debug
    assert "dense   embedding_layer.word_embeddings.weight" in debug


def test_bad_params_exit_2_naming_the_field(tmp_path, capsys):
    params = tmp_path / "bad.yaml"
    params.write_text("train_input: {batch_sz: 4}\n")
    assert cli.main(["run", "--params", str(params), "--validate_only"]) == 2
    assert "train_input.batch_sz" in capsys.readouterr().err
    params.write_text("model: {hidden_sise: 4}\n")
    assert cli.main(["run", "--params", str(params), "--validate_only"]) == 2
    assert "did you mean 'hidden_size'" in capsys.readouterr().err
    assert cli.main(["run", "--params", str(tmp_path / "none.yaml"), "--validate_only"]) == 2
    assert "is not a file" in capsys.readouterr().err
    params.write_text("train_input: {batch_size: 6}\n")
    assert cli.main(["run", "--params", str(params), "--num_csx", "4", "--validate_only"]) == 2
    assert "num_csx (4)" in capsys.readouterr().err


def test_plan_counts_and_unmatched_group():
    spec = JobSpec.from_yaml(RUN_SPEC)
    plan = plan_report(plan_job(spec, 2))
    sparse = [layer for layer in plan["layers"] if layer["sparse"]]
    assert len(sparse) == 14 and all(layer["nnz"] == layer["numel"] // 4 for layer in sparse)
    flops = plan["flops_per_token"]
    assert flops["sparse_train"] < flops["dense_train"] and plan["batch_per_csx"] == 2
    nothing = JobSpec.from_yaml(RUN_SPEC.replace(
        "sparsity: {algorithm: static, sparsity: 0.75}",
        "sparsity: [{param_filter: '*.ffn.*', sparsity: 0.5}, {param_filter: 'encoder.*', sparsity: 0.9}]"))
    with pytest.raises(ValueError, match="group 1 .*matches no parameter"):
        plan_report(plan_job(nothing, 1))


def test_run_then_finalize_round_trip(tmp_path, capsys, ray_session):
    params = tmp_path / "job.yaml"
    params.write_text(RUN_SPEC)
    model_dir = tmp_path / "run"
    assert cli.main(["run", "--params", str(params), "--model_dir", str(model_dir),
                     "--cpus_per_csx", "1"]) == 0
    captured = capsys.readouterr()
    assert "step 4/4" in captured.err and "tok/s" in captured.err  # plain lines off a TTY
    summary = json.loads(captured.out)  # one system through the worker group, as the flag says
    assert summary["cpus_per_csx"] == 1 and [w["threads"] for w in summary["workers"]] == [1]
    trained = model_dir / "checkpoint_4.mdl"
    out, csr = tmp_path / "final.mdl", tmp_path / "final.npz"
    assert cli.main(["finalize", "--input", str(trained), "--output", str(out), "--csr", str(csr)]) == 0

    state, final = load_checkpoint(trained), load_checkpoint(out)
    assert not [k for k in final["model"] if k.endswith("_mask")]
    name = "transformer_decoder.layers.0.ffn.ffn.0.linear_layer_for_glu.weight"
    masked = state["model"][name] * state["model"][name + "_mask"]
    assert torch.equal(final["model"][name], masked)
    # the finalized checkpoint loads strictly into a plain dense model (no mask buffers)
    dense = build_model(model_config(JobSpec.from_yaml(RUN_SPEC), 256, 16), seed=123)
    dense.load_state_dict(final["model"])
    arrays = np.load(csr)
    rows = np.repeat(np.arange(masked.shape[0]), np.diff(arrays[f"{name}/indptr"]))
    rebuilt = np.zeros(tuple(arrays[f"{name}/shape"]), dtype=np.float32)
    rebuilt[rows, arrays[f"{name}/indices"]] = arrays[f"{name}/values"]
    assert np.array_equal(rebuilt, masked.numpy())


def test_finalize_missing_input_is_an_error(tmp_path, capsys):
    assert cli.main(["finalize", "--input", str(tmp_path / "none.mdl"), "--output", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err


# study*.yaml are POST /v1/studies bodies, checked in tests/service (local stack, study variants).
JOB_EXAMPLES = sorted(p.name for p in EXAMPLES.glob("*.yaml") if not p.name.startswith("study"))
DENSE_EXAMPLES = {"nanogpt_shakespeare_gpu.yaml"}


@pytest.mark.parametrize("example", JOB_EXAMPLES)
def test_examples_load_configure_and_plan(example):
    import sparsity

    spec = JobSpec.from_yaml((EXAMPLES / example).read_text())
    plan = plan_report(plan_job(spec, 1))
    if example in DENSE_EXAMPLES:  # nanoGPT's own configuration, the dense anchor
        assert spec.sparsity is None and not plan["groups"]
        assert plan["flops_per_token"]["sparse_train"] == plan["flops_per_token"]["dense_train"] > 0
        return
    sparsity.configure(spec.sparsity)
    assert plan["groups"] and plan["flops_per_token"]["sparse_train"] > 0


def test_progress_says_in_words_when_the_mlflow_server_leaves_and_comes_back():
    import io

    from tracking.server import MLFLOW_AWAY, MLFLOW_BACK

    out = io.StringIO()
    printer = cli.ProgressPrinter(out)
    printer({"event": MLFLOW_AWAY, "reason": "connection refused"})
    printer({"event": MLFLOW_BACK})
    assert out.getvalue().splitlines() == [
        "[csx] the MLflow server does not answer (connection refused): training goes on, its "
        "metrics and masks wait in the model_dir's mlflow_spool/ until it does",
        "[csx] the MLflow server answers again: what the run kept is sent"]
