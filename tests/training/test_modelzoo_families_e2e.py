"""Issues 21 and 33, done when: every decoder family of the ModelZoo corpus trains a scaled-down proxy
(its published file unchanged, shrunk with --set, on tiny HDF5 data) on 2 simulated systems
for 20 steps, every layer at the file's target and equal masks on both replicas, all families in
turn inside one job (one group start); one file also through `csx run`, read back from MLflow, and
the Mixtral proxy with RigL inside each expert. The architecture keys
that make each family what it is (GQA, RoPE scaling, sliding window, ALiBi, muP) stay as
published; only sizes shrink."""

import json
import sys
from pathlib import Path

import pytest
import ray.cloudpickle
import torch
from mlflow import MlflowClient

from csx_config import JobSpec
from csx import cli
from training.checkpoint import checkpoint_path, load_checkpoint
from training.build import build_sparse_model
from models.config import ModelConfig
from training.report import plan_report
from workers.runner import run_job
from training_helpers import preprocess_texts
from training.plan import plan_job

# The per-rank loop below runs inside Ray actors, which cannot import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]
CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "modelzoo_corpus"
TEXT = "".join(f"{i}: to be, or not to be, that is the question.\n" for i in range(60))
SEQ = 16
ROTARY = {"model.rotary_dim": 8}  # the proxy's head size (32 / 4 heads)
GQA = {"model.extra_attention_params.num_kv_groups": 2}  # 4 query heads share 2 key/value heads
# One corpus file trains through `csx run` and shows in MLflow (the CLI path every family shares);
# every other family trains in turn inside one 2-system job (FAMILIES_IN_ONE_JOB), which costs one
# group start instead of one per family.
CLI_FILE = "gpt3/trainer/r2.4.0_sparsity_pretraining_params_gpt3_125m_rigl75.yaml"


@pytest.fixture(scope="module")
def hdf5_data(tmp_path_factory):
    return preprocess_texts(tmp_path_factory.mktemp("families-data"),
                            {"train": TEXT[:2400], "val": TEXT[2400:]}, SEQ)


def _proxy_overrides(data: Path, family_keys: dict) -> list[str]:
    """`key=value` overrides that shrink a published file to the proxy trained here."""
    overrides = {
        "model.num_hidden_layers": 1, "model.hidden_size": 32, "model.num_heads": 4,
        "model.filter_size": 64, "model.vocab_size": 256, "model.max_position_embeddings": SEQ,
        **family_keys,
        "train_input.data_dir": data / "train", "eval_input.data_dir": data / "val",
        "train_input.max_sequence_length": SEQ, "eval_input.max_sequence_length": SEQ,
        "train_input.batch_size": 4, "eval_input.batch_size": 4,
        "runconfig.max_steps": 20, "runconfig.log_steps": 10, "runconfig.checkpoint_steps": 20,
        "runconfig.eval_frequency": 20, "runconfig.eval_steps": 1,
        "runconfig.mlflow_experiment": "modelzoo-families",
        "runconfig.sparse_kernel": "dense",  # no CSR-vs-dense timing calibration: fast and exact
    }
    return [f"{key}={value}" for key, value in overrides.items()]


def _proxy(data: Path, family_keys: dict) -> list[str]:
    return [arg for override in _proxy_overrides(data, family_keys) for arg in ("--set", override)]


def test_a_corpus_file_trains_a_proxy_through_csx_run_on_2_systems_with_sparsity_at_target(
        hdf5_data, tmp_path, tracking_uri, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    args = ["run", "--params", str(CORPUS / CLI_FILE), "--num_csx", "2", "--model_dir", str(tmp_path / "run"),
            *_proxy(hdf5_data, {})]
    assert cli.main(args) == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 20 and summary["num_csx"] == 2

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(summary["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["model.hidden_size"] == "32"
    target = float(run.data.params["target_sparsity"])
    assert target > 0
    history = client.get_metric_history(run.info.run_id, "sparsity/global")
    assert [m.step for m in history][-1] == 20
    assert all(m.value == pytest.approx(target, abs=0.01) for m in history), [m.value for m in history]
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in losses] == [10, 20] and all(m.value > 0 for m in losses)


def test_mixtral_proxy_trains_rigl_inside_each_expert_with_per_expert_sparsity(hdf5_data, tmp_path, tracking_uri,
                                                                                 monkeypatch, capsys):
    """ModelZoo's MoE 111M file (RigL on '*linear_layer.weight', ScalePerParamLR) on 2 systems:
    every expert matrix has its own mask at the target, RigL moves weights within each expert
    (same count, other positions), the router stays dense, and the run shows each expert's
    sparsity and router load."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    run_dir = tmp_path / "run"
    args = ["run", "--params", str(CORPUS / "mixtral/trainer/r2.5.0_params_moe_111M_base.yaml"), "--num_csx", "2",
            "--model_dir", str(run_dir), *_proxy(hdf5_data, {"model.moe.num_experts": 4, "model.moe.top_k": 2,
                                                             "sparsity.update.freq": 5})]
    assert cli.main(args) == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    run = MlflowClient(tracking_uri=tracking_uri).get_run(summary["run_id"])
    target = float(run.data.params["target_sparsity"])
    experts = {key: value for key, value in run.data.metrics.items() if key.startswith("weights/sparsity/L00.expert")}
    assert sorted(experts) == [f"weights/sparsity/L00.expert{e}.ffn{i}" for e in range(4) for i in (0, 1)]
    assert all(value == pytest.approx(target, abs=0.01) for value in experts.values()), experts
    per_expert = {key: value for key, value in run.data.metrics.items() if key.startswith("experts/sparsity/")}
    assert sorted(per_expert) == [f"experts/sparsity/L00.expert{e}" for e in range(4)]
    assert all(value == pytest.approx(target, abs=0.01) for value in per_expert.values()), per_expert
    # Rank 0 logs the router load of the global batch: each layer's shares of its assignments sum to 1.
    loads = {key: value for key, value in run.data.metrics.items() if key.startswith("router/load/")}
    assert sorted(loads) == [f"router/load/L00.expert{e}" for e in range(4)]
    assert sum(loads.values()) == pytest.approx(1.0)

    final = load_checkpoint(checkpoint_path(run_dir, 20))
    spec = JobSpec.model_validate(final["spec"])
    start, _ = build_sparse_model(ModelConfig(**final["model_config"]), plan_job(spec).sparsity,
                                  seed=spec.runconfig.seed)
    initial = dict(start.named_buffers())
    masks = {name: mask for name, mask in final["model"].items() if name.endswith("_mask")}
    assert not any("gate" in name for name in masks)
    for expert in range(4):
        name = f"transformer_decoder.layers.0.ffn.experts.experts.{expert}.0.linear_layer.weight_mask"  # 2.10 names
        assert int(masks[name].sum()) == int(initial[name].sum())  # RigL keeps each expert's count...
        assert not torch.equal(masks[name], initial[name])  # ...and grows inside that expert


TWO_LAYERS = {"model.num_hidden_layers": 2}
UPDATE_EVERY_5 = {"sparsity.update.freq": 5}  # SET / RigL move masks within the 20 steps
PARALLEL = {"model_class": "GPTJModel", "position_embedding_type": "rotary"}
MQA = {"kv_heads": 1}
# family -> (corpus file, what shrinking that family's features needs besides the sizes, the
# plan's model fields showing those features built), each at its file's target.
FAMILIES_IN_ONE_JOB = {
    "gpt2": ("gpt2/params_v1/r1.7.0_params_gpt2_small.yaml", TWO_LAYERS,
             {"position_embedding_type": "learned", "norm_type": "layernorm", "nonlinearity": "gelu"}),
    "cerebras-gpt-mup": ("gpt3/params_v1/r1.9.1_Cerebras_GPT_111m_mup.yaml", TWO_LAYERS,
                         {"embeddings_scale": 10.0, "scale_qk_dot_by_d": True}),
    "llama2": ("llama/params_v2/r2.1.0_params_llama2_13b.yaml", {**TWO_LAYERS, **ROTARY},
               {"norm_type": "rmsnorm", "nonlinearity": "swiglu", "position_embedding_type": "rotary"}),
    "llama3-gqa-rope-scaling": ("llama/params_v2/r2.3.1_params_llama3p1_8b_msl_8k.yaml",
                                {**TWO_LAYERS, **ROTARY, **GQA}, {"pos_scaling_type": "llama3", "kv_heads": 2}),
    "mistral-sliding-window": ("mistral/trainer/r2.4.0_params_mistral_7B.yaml",
                               {**TWO_LAYERS, **ROTARY, **GQA, "model.attention_sliding_window_length": SEQ // 2},
                               {"attention_sliding_window_length": SEQ // 2, "kv_heads": 2}),
    "btlm-alibi-mup": ("btlm/trainer/r2.5.0_params_btlm_2p7b_8k.yaml", TWO_LAYERS,
                       {"position_embedding_type": "alibi", "mup_base_hidden_size": 256.0}),
    "falcon-parallel-mqa": ("falcon/trainer/r2.5.0_params_falcon_7b.yaml", {**TWO_LAYERS, **ROTARY},
                            {**PARALLEL, **MQA}),
    "gemma2-softcap-sandwich-alternating-window": (
        "gemma2/trainer/r2.5.0_params_gemma2_9b_msl8k.yaml",
        {**TWO_LAYERS, **ROTARY, **GQA, "model.attention_inner_dim": 32,
         "model.attention_sliding_window_length": SEQ // 2},
        {"final_logit_softcapping": 30.0, "norm_first_sandwich": True,
         "sliding_window_every_other_decoder_layer": True}),
    "bloom-alibi": ("bloom/trainer/r2.5.0_params_bloom_7b.yaml", TWO_LAYERS,
                    {"position_embedding_type": "alibi"}),
    "gptj-parallel-rotary": ("gptj/trainer/r2.5.0_params_gptj_6B.yaml", {**TWO_LAYERS, **ROTARY},
                             {**PARALLEL, "use_untied_layer_norm": False}),
    "gpt-neox-untied-norms-set": ("gptj/params_v2/r2.2.1_params_gpt_neox_20B.yaml",
                                  {**TWO_LAYERS, **ROTARY, "sparsity.schedule.freq": 5},
                                  {**PARALLEL, "use_untied_layer_norm": True}),
    "jais-alibi-swiglu-mup": ("jais/trainer/r2.5.0_params_jais_13b.yaml", TWO_LAYERS,
                              {"position_embedding_type": "alibi", "nonlinearity": "swiglu",
                               "mup_base_hidden_size": 256.0}),
    "mpt-biasless-layernorm-set": ("mpt/params_v2/r2.2.1_params_mpt_7B.yaml", {**TWO_LAYERS, **UPDATE_EVERY_5},
                                   {"norm_type": "biasless-layernorm", "position_embedding_type": "alibi"}),
    "santacoder-mqa-rigl": ("santacoder/trainer/r2.5.0_params_santacoder_1b.yaml",
                            {**TWO_LAYERS, **UPDATE_EVERY_5}, MQA),
    "starcoder-mqa": ("starcoder/trainer/r2.5.0_params_starcoder_15b.yaml", TWO_LAYERS, MQA),
}
MASKS_MOVE = {"gpt-neox-untied-norms-set", "mpt-biasless-layernorm-set", "santacoder-mqa-rigl"}


def train_families_in_turn(specs: dict[str, JobSpec]):
    """A per-rank loop for the runner: the real loop (training.loop.train) on each family's
    spec in turn, in one group of 2 actors. Each rank writes what its replica ended with
    (mask hashes at every update, final density per layer) to rank<r>.json."""
    def train_each(plan, *, model_dir, rank, **loop_args):
        from training.loop import train

        del plan  # the runner's plan only sized the group; each family brings its own
        ended = {}
        for family, family_spec in specs.items():
            summary = train(plan_job(family_spec), model_dir=f"{model_dir}/{family}", rank=rank, **loop_args)
            ended[family] = {key: summary[key] for key in ("steps", "train_loss", "mask_hashes", "layer_density")}
        Path(model_dir, f"rank{rank}.json").write_text(json.dumps(ended))
        return {}
    return train_each


@pytest.fixture(scope="module")
def families_trained_in_one_job(hdf5_data, tmp_path_factory, ray_session):
    """Each family's spec and, per rank, what its replica ended with."""
    specs = {family: JobSpec.from_yaml((CORPUS / path).read_text(),
                                       [*_proxy_overrides(hdf5_data, keys), "runconfig.num_csx=2"])
             for family, (path, keys, _) in FAMILIES_IN_ONE_JOB.items()}
    model_dir = tmp_path_factory.mktemp("families-one-job")
    run_job(plan_job(next(iter(specs.values())), 2), model_dir=str(model_dir), tracking=False,
            train_fn=train_families_in_turn(specs))
    return specs, [json.loads((model_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("family", FAMILIES_IN_ONE_JOB)
def test_every_family_trains_in_one_2_system_job_each_layer_at_target_replicas_equal(
        family, families_trained_in_one_job):
    specs, ranks = families_trained_in_one_job
    replica0, replica1 = ranks[0][family], ranks[1][family]
    assert replica0["steps"] == replica1["steps"] == 20
    assert replica0["train_loss"] > 0
    # Identical masks on both replicas, at the start and after every update.
    assert replica0["mask_hashes"] == replica1["mask_hashes"]
    if family in MASKS_MOVE:
        steps = [step for step, _ in replica0["mask_hashes"]]
        assert steps == [0, 5, 10, 15, 20]
        assert len({digest for _, digest in replica0["mask_hashes"]}) == 5  # every update moved them
    # Every layer at the level the plan schedules for it (the file's target), on both replicas.
    plan = plan_report(plan_job(specs[family], 2))
    features = FAMILIES_IN_ONE_JOB[family][2]
    assert {key: plan["model"][key] for key in features} == features
    planned = {layer["name"]: layer["sparsity"] for layer in plan["layers"] if layer["sparse"]}
    assert planned and all(level >= 0.5 for level in planned.values())
    for replica in (replica0, replica1):
        reached = {name: 1.0 - density for name, density in replica["layer_density"].items()}
        assert reached.keys() == planned.keys()
        assert all(reached[name] == pytest.approx(planned[name], abs=1e-3) for name in planned), reached
