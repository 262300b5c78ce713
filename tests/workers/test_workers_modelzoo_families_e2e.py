"""Issue 21, done when: every decoder family of the ModelZoo corpus trains a scaled-down proxy
(its published file unchanged, shrunk with --set, on tiny HDF5 data) on 2 simulated systems
for 20 steps, with the sparsity held at the file's target in MLflow. The architecture keys
that make each family what it is (GQA, RoPE scaling, sliding window, ALiBi, muP) stay as
published; only sizes shrink."""

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from workers import cli
from workers_helpers import preprocess_texts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]
CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "modelzoo_corpus"
TEXT = "".join(f"{i}: to be, or not to be, that is the question.\n" for i in range(60))
SEQ = 16
ROTARY = {"model.rotary_dim": 8}  # the proxy's head size (32 / 4 heads)
GQA = {"model.extra_attention_params.num_kv_groups": 2}  # 4 query heads share 2 key/value heads
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
