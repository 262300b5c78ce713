"""Restarts through `csx run` (issue 14, item 8, and item 7's --python_paths), as a user hits
them on one system: a sparse run from a dense checkpoint, from a cstorch NaN-sentinel checkpoint,
a sparse checkpoint under params without a sparsity section, and re-running a finished model_dir
with a new sparsity level (iterative pruning)."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest
import torch

import sparsity
from csx import cli
from training.checkpoint import checkpoint_path, load_checkpoint

pytestmark = pytest.mark.usefixtures("ray_session")  # `csx run` trains on the session's Ray
BASE = """
train_input: {batch_size: 4, max_sequence_length: 16}
eval_input: {batch_size: 4, max_sequence_length: 16}
model: {preset: tiny}
optimizer: {optimizer_type: AdamW, learning_rate: 1.0e-3}
runconfig: {max_steps: 3, log_steps: 3, eval_steps: 1, mlflow_experiment: "", sparse_kernel: dense}
"""
WEIGHT = "transformer_decoder.layers.0.ffn.ffn.0.linear_layer.weight"


def params(tmp_path: Path, name: str, sparsity_section: str = "") -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(BASE + sparsity_section, encoding="utf-8")
    return str(path)


def csx_run(params_file: str, model_dir: Path, *extra: str) -> int:
    return cli.main(["run", "--params", params_file, "--model_dir", str(model_dir), *extra])


def kept(model_dir: Path, step: int) -> torch.Tensor:
    return load_checkpoint(checkpoint_path(model_dir, step))["model"][WEIGHT + "_mask"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A dense run and a static 50% run, 3 steps each."""
    root = tmp_path_factory.mktemp("restarts")
    dense, sparse = root / "dense", root / "sparse"
    assert csx_run(params(root, "dense"), dense) == 0
    assert csx_run(params(root, "static50", "sparsity: {algorithm: static, sparsity: 0.5}"), sparse) == 0
    return root, dense, sparse


def test_a_sparse_run_starts_from_a_dense_checkpoint(finished, tmp_path):
    root, dense, _ = finished
    rigl = params(tmp_path, "rigl", "sparsity: {algorithm: rigl, sparsity: 0.75, update: {freq: 2}}")
    assert csx_run(rigl, tmp_path / "run", "--checkpoint_path", str(checkpoint_path(dense, 3))) == 0
    state = load_checkpoint(checkpoint_path(tmp_path / "run", 6))  # a new phase: steps 4-6
    mask = state["model"][WEIGHT + "_mask"]
    assert int(mask.sum()) == sparsity.keep_count(mask.numel(), 0.75)
    assert state["phase_start"] == 3 and state["sparsity"]["step"] == 3


def test_a_sparse_run_starts_from_a_nan_sentinel_checkpoint(finished, tmp_path):
    _, _, sparse = finished
    nan_checkpoint = tmp_path / "cstorch.mdl"
    assert cli.main(["finalize", "--input", str(checkpoint_path(sparse, 3)), "--output", str(nan_checkpoint),
                     "--mode", "nan"]) == 0
    assert "optimizer" not in load_checkpoint(nan_checkpoint)
    static = params(tmp_path, "static50", "sparsity: {algorithm: static, sparsity: 0.5}")
    assert csx_run(static, tmp_path / "run", "--checkpoint_path", str(nan_checkpoint)) == 0
    assert torch.equal(kept(tmp_path / "run", 6), kept(sparse, 3))  # masks recovered from the NaNs


def test_a_sparse_checkpoint_under_params_without_sparsity_says_what_to_do(finished, tmp_path, capsys):
    root, _, sparse = finished
    code = csx_run(params(root, "dense"), tmp_path / "run", "--checkpoint_path", str(checkpoint_path(sparse, 3)))
    err = capsys.readouterr().err
    assert code == 2
    assert "no sparsity section" in err and "csx finalize" in err and "Unexpected key" not in err


def test_rerunning_a_finished_model_dir_with_a_new_level_prunes_further(finished, tmp_path, caplog):
    root, _, sparse = finished
    model_dir = tmp_path / "iterative"
    model_dir.mkdir()
    source = load_checkpoint(checkpoint_path(sparse, 3))
    torch.save(source, checkpoint_path(model_dir, 3))
    with caplog.at_level(logging.WARNING, logger="csx"):
        assert csx_run(params(root, "static50", "sparsity: {algorithm: static, sparsity: 0.5}"), model_dir) == 0
    assert "nothing to train" in caplog.text and not checkpoint_path(model_dir, 6).exists()

    higher = params(tmp_path, "static75", "sparsity: {algorithm: static, sparsity: 0.75}")
    assert csx_run(higher, model_dir) == 0
    before, after = kept(model_dir, 3), kept(model_dir, 6)
    assert int(after.sum()) == sparsity.keep_count(after.numel(), 0.75)
    assert not bool((after & ~before).any())  # pruned weights stay pruned
    weight = load_checkpoint(checkpoint_path(model_dir, 6))["model"][WEIGHT]
    assert not bool(weight[~after].any())


def test_python_paths_load_a_custom_algorithm_named_in_the_params(tmp_path, monkeypatch):
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    (code_dir / "cli_algos.py").write_text(textwrap.dedent("""
        import sparsity

        class CliEveryOther(sparsity.SparsityAlgorithm):
            \"\"\"Keeps every other weight of each sparse parameter.\"\"\"

            def update(self, optimizer=None):
                for sparse_param in self.sparse_params.values():
                    mask = sparse_param.mask.clone().reshape(-1)
                    mask[:] = False
                    mask[::2] = True
                    sparse_param.mask = mask.reshape(sparse_param.mask.shape)
    """))
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    monkeypatch.delenv(sparsity.plugins.ENV_VAR, raising=False)
    custom = params(tmp_path, "custom", "sparsity: {algorithm: CliEveryOther, sparsity: 0.5}")
    assert csx_run(custom, tmp_path / "run", "--python_paths", str(code_dir)) == 0
    mask = kept(tmp_path / "run", 3).reshape(-1)
    assert mask[::2].all() and not mask[1::2].any()
