"""Issues 21 and 33, done when: every decoder family of the ModelZoo corpus trains a scaled-down proxy
(its published file unchanged, shrunk with --set, on tiny HDF5 data) on 2 simulated systems
for 20 steps, with the sparsity held at the file's target in MLflow. The architecture keys
that make each family what it is (GQA, RoPE scaling, sliding window, ALiBi, muP) stay as
published; only sizes shrink."""

import json
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from csx_config import JobSpec
from workers import cli
from workers.checkpoint import checkpoint_path, load_checkpoint
from workers.build import build_sparse_model
from workers.model import ModelConfig
from workers_helpers import preprocess_texts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]
CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "modelzoo_corpus"
TEXT = "".join(f"{i}: to be, or not to be, that is the question.\n" for i in range(60))
SEQ = 16
ROTARY = {"model.rotary_dim": 8}  # the proxy's head size (32 / 4 heads)
GQA = {"model.extra_attention_params.num_kv_groups": 2}  # 4 query heads share 2 key/value heads
# StarCoder (its scale_qk_dot_by_layer_idx: False changes nothing: a GPT-2 with multi-query
# attention), MPT (ALiBi as BTLM, a LayerNorm without bias) and GPT-J / NeoX (Falcon's parallel
# block, with untied norms in NeoX) add no block of their own here; their keys are tested in
# test_workers_model_families.py, which keeps this file's time down.
# family -> (corpus file, what shrinking that family's features needs besides the sizes,
#            MLflow params showing the family's feature keys reached the run)
FAMILIES = {
    "gpt2": ("gpt2/params_v1/r1.7.0_params_gpt2_small.yaml", {}, {}),
    "gpt3": ("gpt3/trainer/r2.4.0_sparsity_pretraining_params_gpt3_125m_rigl75.yaml", {}, {}),
    "cerebras-gpt-mup": ("gpt3/params_v1/r1.9.1_Cerebras_GPT_111m_mup.yaml", {},
                         {"model.embeddings_scale": "10.0", "model.scale_qk_dot_by_d": "True",
                          "optimizer.adjust_learning_rate.decoder_kernel": str(1 / 3)}),
    "llama2": ("llama/params_v2/r2.1.0_params_llama2_13b.yaml", ROTARY, {"model.norm_type": "rmsnorm"}),
    "llama3-gqa-rope-scaling": ("llama/params_v2/r2.3.1_params_llama3p1_8b_msl_8k.yaml", {**ROTARY, **GQA},
                                {"model.pos_scaling_type": "llama3", "model.extra_attention_params.num_kv_groups": "2"}),
    "mistral-sliding-window": ("mistral/trainer/r2.4.0_params_mistral_7B.yaml",
                               {**ROTARY, **GQA, "model.attention_sliding_window_length": SEQ // 2},
                               {"model.attention_sliding_window_length": str(SEQ // 2)}),
    "btlm-alibi-mup": ("btlm/trainer/r2.5.0_params_btlm_2p7b_8k.yaml", {},
                       {"model.position_embedding_type": "alibi", "model.mup_base_hidden_size": "256.0"}),
    "falcon-parallel-mqa": ("falcon/trainer/r2.5.0_params_falcon_7b.yaml", ROTARY,
                            {"model.name": "falcon", "model.extra_attention_params.num_kv_groups": "1"}),
    "gemma2-softcap-sandwich-alternating-window": (
        "gemma2/trainer/r2.5.0_params_gemma2_9b_msl8k.yaml",
        {**ROTARY, **GQA, "model.attention_inner_dim": 32, "model.num_hidden_layers": 2,
         "model.attention_sliding_window_length": SEQ // 2},
        {"model.final_logit_softcapping": "30.0", "model.norm_first_sandwich": "True",
         "model.sliding_window_every_other_decoder_layer": "True"}),
}


@pytest.fixture(scope="module")
def hdf5_data(tmp_path_factory):
    return preprocess_texts(tmp_path_factory.mktemp("families-data"),
                            {"train": TEXT[:2400], "val": TEXT[2400:]}, SEQ)


def _proxy(data: Path, family_keys: dict) -> list[str]:
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
    return [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_a_proxy_on_2_systems_with_sparsity_at_target(family, hdf5_data, tmp_path,
                                                                          tracking_uri, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    path, family_keys, features = FAMILIES[family]
    args = ["run", "--params", str(CORPUS / path), "--num_csx", "2", "--model_dir", str(tmp_path / "run"),
            *_proxy(hdf5_data, family_keys)]
    assert cli.main(args) == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 20 and summary["num_csx"] == 2

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(summary["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["model.hidden_size"] == "32"
    assert {key: run.data.params.get(key) for key in features} == features
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
    (same count, other positions), and the router stays dense."""
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

    final = load_checkpoint(checkpoint_path(run_dir, 20))
    spec = JobSpec.model_validate(final["spec"])
    start, _ = build_sparse_model(spec, ModelConfig(**final["model_config"]))
    initial = dict(start.named_buffers())
    masks = {name: mask for name, mask in final["model"].items() if name.endswith("_mask")}
    assert not any("gate" in name for name in masks)
    for expert in range(4):
        name = f"transformer_decoder.layers.0.ffn.experts.experts.{expert}.ffn.0.linear_layer.weight_mask"
        assert int(masks[name].sum()) == int(initial[name].sum())  # RigL keeps each expert's count...
        assert not torch.equal(masks[name], initial[name])  # ...and grows inside that expert
