"""End to end: a scaled-down GPT-3 and a scaled-down Llama (ModelZoo files + --set) train on 2
simulated systems from HDF5 data made by `csx preprocess`, log to MLflow, checkpoint, resume."""

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from csx import cli
from training_helpers import preprocess_texts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]
MODELZOO = Path(__file__).resolve().parents[2] / "examples" / "modelzoo"
TEXT = "".join(f"{i}: to be, or not to be, that is the question.\n" for i in range(60))


@pytest.fixture(scope="module")
def hdf5_data(tmp_path_factory):
    return preprocess_texts(tmp_path_factory.mktemp("e2e-data"),
                            {"train": TEXT[:2400], "val": TEXT[2400:]}, 16)


def _proxy(data: Path, max_steps: int) -> list[str]:
    overrides = {
        "model.num_hidden_layers": 1, "model.hidden_size": 32, "model.num_heads": 2,
        "model.filter_size": 64, "model.vocab_size": 256, "model.max_position_embeddings": 16,
        "train_input.data_dir": f"[{data / 'train'}]", "eval_input.data_dir": data / "val",
        "train_input.batch_size": 4, "eval_input.batch_size": 4, "runconfig.max_steps": max_steps,
        "runconfig.checkpoint_steps": 2, "runconfig.log_steps": 2, "runconfig.eval_steps": 1,
        "runconfig.mlflow_experiment": "modelzoo-e2e", "sparsity.update.freq": 2,
        "sparsity.update.stop": 4, "sparsity.drop_fraction.half_period": 4,
        "runconfig.sparse_kernel": "dense",  # no CSR-vs-dense timing calibration: fast and exact
    }
    return [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]


def _run(params: Path, model_dir: Path, overrides: list[str], capsys, num_csx: int) -> dict:
    assert cli.main(["run", "--params", str(params), "--num_csx", str(num_csx), "--model_dir", str(model_dir),
                     *overrides]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("params, extra, initial", [
    ("params_gpt3_125m_rigl75.yaml", [], []),
    # the published Llama-2 file asks for runconfig.save_initial_checkpoint
    ("params_llama2_7b_rigl80.yaml", ["--set", "model.rotary_dim=16"], ["checkpoint_0.mdl"]),
])
def test_scaled_down_modelzoo_file_trains_checkpoints_and_resumes(params, extra, initial, hdf5_data, tmp_path,
                                                                   tracking_uri, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    model_dir = tmp_path / "run"
    first = _run(MODELZOO / params, model_dir, _proxy(hdf5_data, 4) + extra, capsys, num_csx=2)
    assert first["steps"] == 4 and first["num_csx"] == 2
    assert sorted(p.name for p in model_dir.glob("checkpoint_*.mdl")) == [*initial, "checkpoint_2.mdl",
                                                                          "checkpoint_4.mdl"]
    run = MlflowClient(tracking_uri=tracking_uri).get_run(first["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["model.hidden_size"] == "32" and run.data.params["num_csx"] == "2"
    losses = MlflowClient(tracking_uri=tracking_uri).get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in losses] == [2, 4] and all(m.value > 0 for m in losses)

    # Resume on the same 2 systems from the step-4 checkpoint.
    resumed = _run(MODELZOO / params, model_dir, _proxy(hdf5_data, 6) + extra, capsys, num_csx=2)
    assert resumed["steps"] == 6 and resumed["num_csx"] == 2 and (model_dir / "checkpoint_6.mdl").is_file()
    history = MlflowClient(tracking_uri=tracking_uri).get_metric_history(resumed["run_id"], "train/loss")
    assert [m.step for m in history] == [6]  # continued at step 5, not restarted
