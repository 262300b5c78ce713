"""The training loop: exact resume in a fresh process, determinism, modes, tracker calls."""

import math
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from training.build import loop_settings
from training.checkpoint import list_checkpoints, load_checkpoint
from csx_config import JobSpec
from training.loop import AFTER_WARMUP, _MetricLog, _record_eval, train
from training_helpers import same_state

torch.set_num_threads(1)  # the fresh process below uses one thread too: same float reductions

SPEC = """
train_input: {batch_size: 8, max_sequence_length: 32}
eval_input: {batch_size: 8, max_sequence_length: 32}
model: {preset: tiny}
optimizer: {optimizer_type: AdamW, learning_rate: [{scheduler: Linear, initial_learning_rate: 0.0, end_learning_rate: 3.0e-3, total_iters: 4}, {scheduler: CosineDecay, initial_learning_rate: 3.0e-3, end_learning_rate: 0.0, total_iters: 16}], weight_decay: 0.1, max_gradient_norm: 1.0}
sparsity: {algorithm: rigl, sparsity: 0.8, update: {freq: 5, stop: 16}, drop_fraction: 0.3}
runconfig: {max_steps: 20, checkpoint_steps: 10, eval_frequency: 10, eval_steps: 2, log_steps: 5, seed: 0, mlflow_experiment: "", sparse_kernel: auto}
"""


class FakeTracker:
    def __init__(self):
        self.metrics, self.mask_updates, self.flushed_at = {}, [], []

    def log_metrics(self, metrics, step):
        self.metrics.setdefault(step, {}).update(metrics)

    def log_mask_update(self, step, masks):
        self.mask_updates.append((step, sorted(masks)))

    def flush(self):
        self.flushed_at.append(max(self.metrics, default=0))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """20 RigL steps straight through, checkpoints at 10 and 20."""
    model_dir = tmp_path_factory.mktemp("reference")
    tracker = FakeTracker()
    summary = train(JobSpec.from_yaml(SPEC), model_dir=str(model_dir), mode="train_and_eval", tracker=tracker)
    return model_dir, summary, tracker


def test_writes_checkpoints_and_returns_summary(reference):
    model_dir, summary, _ = reference
    assert [step for step, _ in list_checkpoints(model_dir)] == [10, 20]
    assert summary["steps"] == 20 and len(summary["train_losses"]) == 20
    assert [e["step"] for e in summary["eval_history"]] == [10, 20]
    assert summary["final_eval_loss"] < 5.0  # from ln(256) = 5.55 at init
    assert [step for step, _ in summary["mask_hashes"]] == [0, 5, 10, 15]
    assert len({h for _, h in summary["mask_hashes"]}) == 4  # RigL changed the masks each update
    assert summary["tokens_per_s"] > 0 and summary["sim_step_ms"] > 0
    assert len(summary["kernels"]) == 14 and set(summary["kernels"].values()) <= {"csr", "dense"}
    assert (model_dir / "kernel_calibration.json").exists()
    assert reference[2].flushed_at == [10, 20]  # metrics reach MLflow at every checkpoint  # the job's kernel rule, reused on resume
    state = load_checkpoint(model_dir / "checkpoint_20.mdl")
    assert {"model", "optimizer", "sparsity", "lr_scheduler", "rng", "data_position", "step", "spec"} <= set(state)
    assert state["data_position"] == {"position": 20}
    mask = state["model"]["transformer_decoder.layers.0.self_attn.proj_q_dense_layer.weight_mask"]
    assert (state["model"]["transformer_decoder.layers.0.self_attn.proj_q_dense_layer.weight"][~mask] == 0).all()


def test_tracker_gets_design_metric_names(reference):
    _, _, tracker = reference
    logged = set().union(*tracker.metrics.values())
    for name in ("train/loss", "lr", "eval/loss", "eval/perplexity", "sparsity/global",
                 "sparsity/transformer_decoder.layers.0.ffn.ffn.0.linear_layer_for_glu.weight/actual",
                 "mask/churn", "mask/itop_rate",
                 "perf/sim_step_ms", "perf/speedup_vs_dense", "perf/scaling_efficiency",
                 "perf/sim_tokens_per_s", "host/tokens_per_s"):
        assert name in logged, name
    assert "perf/tokens_per_s" not in logged  # the host's throughput is no projection
    # the initial mask's sparsity at 0, then batched on log steps (updates at 5, 10, 15)
    assert sorted(tracker.metrics) == [0, 5, 10, 15, 20]
    assert [step for step, _ in tracker.mask_updates] == [0, 5, 10, 15]
    assert "mask/churn" not in tracker.metrics[20]  # no update at 20: no stale churn


def test_perplexity_after_warmup_repeats_the_evaluations_past_the_warmup(reference):
    """SPEC warms up for 4 steps and evaluates at 10 and 20: both past it."""
    _, summary, tracker = reference
    after = {step: m[AFTER_WARMUP] for step, m in tracker.metrics.items() if AFTER_WARMUP in m}
    assert after == {e["step"]: e["perplexity"] for e in summary["eval_history"]}


def test_no_perplexity_after_warmup_until_the_warmup_is_over():
    tracker, summary = FakeTracker(), {"eval_history": []}
    run = SimpleNamespace(settings=loop_settings(JobSpec.from_yaml(SPEC)), phase_start=0, best_eval_loss=math.inf)
    for run.step in (2, 4, 5):  # SPEC warms up for 4 steps
        _record_eval(run, {"eval/loss": 2.0, "eval/perplexity": 7.4}, summary, _MetricLog(tracker))
    assert [step for step, m in sorted(tracker.metrics.items()) if AFTER_WARMUP in m] == [5]
    assert sorted(tracker.metrics) == [2, 4, 5]


def test_resume_in_fresh_process_is_bit_identical(reference, tmp_path):
    model_dir, summary, _ = reference
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copy(model_dir / "checkpoint_10.mdl", resumed_dir)
    shutil.copy(model_dir / "tokenizer.json", resumed_dir)
    # The job's kernel choice, as a resume finds it: calibrated afresh on a busy machine, CSR
    # and dense could swap and round differently.
    shutil.copy(model_dir / "kernel_calibration.json", resumed_dir)
    code = textwrap.dedent(f"""
        import json, sys, torch
        torch.set_num_threads(1)
        from csx_config import JobSpec
        from training.loop import train
        summary = train(JobSpec.from_yaml(sys.stdin.read()), model_dir={str(resumed_dir)!r}, mode="train")
        print(json.dumps({{"losses": summary["train_losses"], "hashes": summary["mask_hashes"]}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], input=SPEC, capture_output=True, text=True, check=True)
    resumed = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert resumed["losses"] == summary["train_losses"][10:]
    assert resumed["hashes"] == summary["mask_hashes"]
    expected, got = (load_checkpoint(d / "checkpoint_20.mdl") for d in (model_dir, resumed_dir))
    for key, tensor in expected["model"].items():
        assert torch.equal(tensor, got["model"][key]), key
    for index, state in expected["optimizer"]["state"].items():
        assert all(torch.equal(v, got["optimizer"]["state"][index][k]) for k, v in state.items())
    assert same_state(got["sparsity"], expected["sparsity"]) and got["sparsity"]["step"] == 20


def test_same_seed_same_losses_and_masks(reference, tmp_path):
    _, summary, _ = reference
    spec = JobSpec.from_yaml(SPEC)
    again = train(spec, model_dir=str(tmp_path / "again"))
    assert again["train_losses"] == summary["train_losses"]
    assert again["mask_hashes"] == summary["mask_hashes"]
    other = train(spec.model_copy(update={"runconfig": spec.runconfig.model_copy(update={"seed": 1})}),
                  model_dir=str(tmp_path / "other"))
    assert other["mask_hashes"][0][1] != summary["mask_hashes"][0][1]


def test_same_seed_same_losses_with_dropout(tmp_path):
    """Dropout draws from the global generator: each run seeds it from runconfig.seed, so what
    ran before in the process does not change the losses."""
    spec = JobSpec.from_yaml(SPEC.replace("max_steps: 20", "max_steps: 3").replace(
        "model: {preset: tiny}", "model: {preset: tiny, dropout_rate: 0.1}"))
    first = train(spec, model_dir=str(tmp_path / "a"), mode="train")["train_losses"]
    torch.rand(1000)  # other work in the same process moves the global generator on
    second = train(spec, model_dir=str(tmp_path / "b"), mode="train")["train_losses"]
    assert first == second


def test_eval_and_eval_all(reference):
    model_dir, summary, _ = reference
    every = train(JobSpec.from_yaml(SPEC), model_dir=str(model_dir), mode="eval_all")
    assert [e["step"] for e in every["eval_history"]] == [10, 20]
    # the same fixed eval batches as during training, on the same weights
    assert [e["loss"] for e in every["eval_history"]] == pytest.approx(
        [e["loss"] for e in summary["eval_history"]], rel=1e-6)
    latest = train(JobSpec.from_yaml(SPEC), model_dir=str(model_dir), mode="eval")
    assert latest["final_eval_loss"] == every["eval_history"][-1]["loss"]


def test_all_reduce_hook_sees_gradients_then_loss(tmp_path):
    calls = []

    def all_reduce(tensors):
        calls.append([tuple(t.shape) for t in tensors])

    spec = JobSpec.from_yaml(SPEC.replace("max_steps: 20", "max_steps: 2"))
    train(spec, model_dir=str(tmp_path), all_reduce=all_reduce)
    calibration, *steps = calls  # the job's kernel calibration is agreed on first
    assert len(calibration) == 1 and len(calibration[0]) == 1
    assert len(steps) == 2 and steps[0][-1] == (1,)  # the loss rides along with the grads
    assert (256, 64) in steps[0]  # the embedding gradient


def test_bad_inputs_raise_naming_the_problem(tmp_path):
    spec = JobSpec.from_yaml(SPEC)
    with pytest.raises(ValueError, match=r"batch_size \(8\).*num_csx \(3\)"):
        train(spec, model_dir=str(tmp_path), rank=0, world_size=3)
    with pytest.raises(ValueError, match="mode"):
        train(spec, model_dir=str(tmp_path), mode="predict")
    with pytest.raises(ValueError, match="needs a checkpoint"):
        train(spec, model_dir=str(tmp_path / "empty"), mode="eval")
    with pytest.raises(ValueError, match="optimizer.optimizer_type"):
        train(JobSpec.from_yaml(SPEC.replace("optimizer_type: AdamW", "optimizer_type: Adamz")), model_dir=str(tmp_path))


def test_dense_run_without_sparsity(tmp_path):
    spec = JobSpec.from_yaml(SPEC.replace(
        "sparsity: {algorithm: rigl, sparsity: 0.8, update: {freq: 5, stop: 16}, drop_fraction: 0.3}\n", "")
        .replace("max_steps: 20", "max_steps: 2"))
    assert spec.sparsity is None
    summary = train(spec, model_dir=str(tmp_path), mode="train_and_eval")
    assert summary["mask_hashes"] == [] and "kernels" not in summary
    assert summary["speedup_vs_dense"] == pytest.approx(1.0) and summary["final_eval_loss"] > 0


def test_replica_mask_check_fails_fast_on_the_first_diverging_update():
    from training.loop import MaskDivergence, _check_replicas_agree

    digest = "ab" * 32
    _check_replicas_agree(5, digest, lambda tensors: None)  # one rank: agrees with itself

    def average_with_other_rank(tensors):  # the other rank hashed different masks
        other = float(int(("cd" * 32)[:12], 16))
        tensors[0].copy_((tensors[0] + other) / 2)

    with pytest.raises(MaskDivergence, match="step 7"):
        _check_replicas_agree(7, digest, average_with_other_rank)


def test_optimizer_uses_the_fused_cpu_kernel_unless_the_class_has_none():
    """Fused Adam(W) is what bench/masked_overhead.py measures at <= 1.05x of dense; the
    default foreach path is slow on the exact zeros of a masked second moment."""
    from training.build import make_optimizer
    from csx_config import OptimizerSpec

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    adamw = make_optimizer(OptimizerSpec(optimizer_type="AdamW", weight_decay=0.1), model)
    assert adamw.defaults["fused"] is True
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.1, 0.0]
    rmsprop = make_optimizer(OptimizerSpec(optimizer_type="RMSprop"), model)
    assert "fused" not in rmsprop.defaults


MOE_SPEC = """
train_input: {batch_size: 4, max_sequence_length: 16}
model: {preset: tiny, moe: {num_experts: 4, top_k: 2}}
sparsity: {algorithm: static, sparsity: 0.5, param_filter: '*linear_layer.weight'}  # ModelZoo's MoE filter
runconfig: {max_steps: 10, log_steps: 5, seed: 0, mlflow_experiment: "", sparse_kernel: dense}
"""


def test_a_moe_run_shows_router_load_and_each_experts_sparsity_in_mlflow(tmp_path, monkeypatch):
    """Rank 0 of 2, with a stand-in collective whose other rank routed each token to the mirror
    image of rank 0's choice. Read back from a local file store (no database schema to create):
    per layer and expert, the router load of every log step (the global batch's: the mean over
    ranks, then over the steps since the last log) and the sparsity of all the expert's
    matrices together."""
    from mlflow import MlflowClient

    from models.transformer import Transformer
    from tracking.tracker import Tracker

    loads, rank0 = [], []  # the tensors router_load returned, and their values on rank 0
    router_load = Transformer.router_load

    def recording_router_load(model):
        loads.append(router_load(model))
        rank0.append(loads[-1].clone())
        return loads[-1]

    def all_reduce(tensors):  # gradients, loss and mask hashes as if both ranks agreed
        for tensor in tensors:
            if any(tensor is load for load in loads):
                tensor.copy_((tensor + tensor.flip(-1)) / 2)

    monkeypatch.setattr(Transformer, "router_load", recording_router_load)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this
    tracking_uri = (tmp_path / "mlruns").as_uri()
    tracker = Tracker("moe-metrics", tracking_uri=tracking_uri)
    train(JobSpec.from_yaml(MOE_SPEC), model_dir=str(tmp_path / "run"), rank=0, world_size=2,
          all_reduce=all_reduce, tracker=tracker)
    tracker.flush()
    client = MlflowClient(tracking_uri=tracking_uri)
    assert len(rank0) == 10  # one per step
    global_loads = [(load + load.flip(-1)) / 2 for load in rank0]
    for layer in range(2):
        histories = [client.get_metric_history(tracker.run_id, f"router/load/L{layer:02d}.expert{e}") for e in range(4)]
        assert all([m.step for m in history] == [5, 10] for history in histories)
        for index, window in enumerate((global_loads[:5], global_loads[5:])):
            logged = [history[index].value for history in histories]
            assert logged == pytest.approx(torch.stack(window).mean(0)[layer].tolist())
            assert sum(logged) == pytest.approx(1.0)
        for expert in range(4):
            history = client.get_metric_history(tracker.run_id, f"experts/sparsity/L{layer:02d}.expert{expert}")
            assert [m.step for m in history] == [0, 5, 10] and all(m.value == pytest.approx(0.5) for m in history)


def test_the_loop_imports_neither_ray_nor_mlflow():
    """training.loop runs where only torch is installed (issue 31): building a run and the loop
    import neither Ray nor MLflow."""
    code = ("import sys, training.loop; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'mlflow'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_evaluation_runs_without_dropout_and_training_resumes_with_it(tmp_path):
    """nanoGPT's estimate_loss evaluates in eval mode; ours evaluated with dropout on (issue 42:
    0.10 of validation loss at the baby-GPT shape with dropout 0.2, docs/science.md). The evaluated loss
    is the model's loss without dropout, the same on every call, and the next training step
    draws dropout again."""
    from training.build import build_run
    from training.loop import evaluate

    spec = JobSpec.from_yaml("model: {preset: tiny, dropout_rate: 0.5, attention_dropout_rate: 0.5}\n"
                             "train_input: {batch_size: 4, max_sequence_length: 16}\n"
                             "eval_input: {batch_size: 4, max_sequence_length: 16}\n"
                             "runconfig: {eval_steps: 2, mlflow_experiment: ''}\n")
    run = build_run(spec, tmp_path, rank=0, world_size=1, device=torch.device("cpu"))
    first, second = evaluate(run, None)["eval/loss"], evaluate(run, None)["eval/loss"]
    assert first == second
    run.model.eval()
    with torch.no_grad():
        plain = sum(float(run.model(x, y)[1]) for x, y in run.eval_data) / len(run.eval_data)
    run.model.train()
    assert first == pytest.approx(plain, rel=1e-6)
    x, y = run.eval_data[0]
    with torch.no_grad():
        assert float(run.model(x, y)[1]) != pytest.approx(plain, rel=1e-6)  # dropout is back
