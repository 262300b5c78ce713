"""Tracker: batched metrics, mask artifacts, nested runs, params, run lifecycle."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from PIL import Image

from workers.plots import block_density
from workers.tracking import (
    PARENT_RUN_TAG,
    Tracker,
    create_run,
    end_run,
    flatten_params,
    pack_masks,
    resolve_tracking_uri,
    run_params,
    unpack_masks,
)


def artifact_dir(client: MlflowClient, run_id: str) -> Path:
    return Path(urlparse(client.get_run(run_id).info.artifact_uri).path)


def test_metrics_are_written_in_batches_of_at_most_1000(tracking_uri, monkeypatch):
    tracker = Tracker("exp", tracking_uri=tracking_uri)
    batch_sizes: list[int] = []
    real_log_batch = tracker.client.log_batch

    def counting_log_batch(run_id, metrics=(), params=(), tags=()):
        batch_sizes.append(len(metrics))
        return real_log_batch(run_id, metrics=metrics, params=params, tags=tags)

    monkeypatch.setattr(tracker.client, "log_batch", counting_log_batch)
    for step in range(1, 701):
        tracker.log_metrics({"train/loss": 5.0 / step, "lr": 1e-3}, step=step)
    tracker.finish()

    assert batch_sizes == [1000, 400]
    history = tracker.client.get_metric_history(tracker.run_id, "train/loss")
    assert len(history) == 700
    assert {m.step: m.value for m in history}[350] == pytest.approx(5.0 / 350)
    assert tracker.client.get_run(tracker.run_id).info.status == "FINISHED"


def test_mask_update_logs_packed_masks_heatmaps_and_histogram(tracking_uri):
    tracker = Tracker("exp", tracking_uri=tracking_uri)
    generator = torch.Generator().manual_seed(0)
    masks = {"layers.0.mlp.up_proj.weight": torch.rand(600, 40, generator=generator) > 0.7,
             "layers.0.attn.q_proj.weight": torch.rand(16, 16, generator=generator) > 0.5}
    tracker.log_mask_update(5, masks)
    tracker.finish()

    folder = artifact_dir(tracker.client, tracker.run_id) / "masks" / "step_0000005"
    assert sorted(p.name for p in folder.iterdir()) == [
        "density_hist.png", "heatmap_layers_0_attn_q_proj_weight.png",
        "heatmap_layers_0_mlp_up_proj_weight.png", "masks.npz"]
    with np.load(folder / "masks.npz") as stored:
        restored = unpack_masks(dict(stored))
    for name, mask in masks.items():
        np.testing.assert_array_equal(restored[name], mask.numpy())
    # the 600-row layer is block-averaged to at most 256 pixels per side
    with Image.open(folder / "heatmap_layers_0_mlp_up_proj_weight.png") as image:
        assert max(image.size) <= 256


def test_mask_update_without_masks_is_an_error(tracking_uri):
    tracker = Tracker("exp", tracking_uri=tracking_uri)
    with pytest.raises(ValueError, match="masks"):
        tracker.log_mask_update(1, {})


def test_finish_writes_curves_and_ends_the_run_once(tracking_uri):
    tracker = Tracker("exp", tracking_uri=tracking_uri)
    for step in range(1, 4):
        tracker.log_metrics({"train/loss": 3.0 - step * 0.1, "eval/perplexity": 20.0 - step},
                            step=step)
    tracker.finish(status="FAILED")
    tracker.finish()  # idempotent: the first status stands
    assert (artifact_dir(tracker.client, tracker.run_id) / "report" / "curves.png").is_file()
    assert tracker.client.get_run(tracker.run_id).info.status == "FAILED"
    with pytest.raises(ValueError, match="status must be one of"):
        tracker.finish(status="DONE")


def test_nested_run_carries_the_parent_tag(tracking_uri):
    parent = create_run("study", tracking_uri=tracking_uri, run_name="study")
    tracker = Tracker("study", tracking_uri=tracking_uri, parent_run_id=parent, run_name="rigl")
    run = tracker.client.get_run(tracker.run_id)
    assert run.data.tags[PARENT_RUN_TAG] == parent
    assert run.info.run_name == "rigl"


def test_attaching_to_an_existing_run_reopens_it_for_a_retry(tracking_uri):
    run_id = create_run("exp", tracking_uri=tracking_uri)
    end_run(run_id, "FAILED", tracking_uri=tracking_uri)
    tracker = Tracker("exp", run_id=run_id, tracking_uri=tracking_uri)
    assert tracker.client.get_run(run_id).info.status == "RUNNING"
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    tracker.finish()
    assert tracker.client.get_run(run_id).info.status == "FINISHED"


def test_params_are_flattened_and_text_and_tags_logged(tracking_uri):
    tracker = Tracker("exp", tracking_uri=tracking_uri)
    tracker.log_params({"optimizer": {"type": "adamw", "learning_rate": 1e-3}, "seed": 1})
    tracker.log_text("train_input:\n  batch_size: 8\n", "params.yaml")
    tracker.set_tags({"csx.state": "RUNNING"})
    run = tracker.client.get_run(tracker.run_id)
    assert run.data.params == {"optimizer.type": "adamw", "optimizer.learning_rate": "0.001",
                               "seed": "1"}
    assert run.data.tags["csx.state"] == "RUNNING"
    assert (artifact_dir(tracker.client, tracker.run_id) / "params.yaml").is_file()


def test_run_params_names_the_design_fields():
    spec = {"train_input": {"batch_size": 8, "seq_len": 32},
            "optimizer": {"learning_rate": 0.01},
            "model": {"preset": "tiny"},
            "runconfig": {"seed": 3},
            "sparsity": {"algorithm": "rigl", "sparsity": 0.9, "init_method": "random",
                         "distribution": "erk", "update": {"freq": 5, "stop": 15},
                         "drop_fraction": {"type": "cosine", "init": 0.3}}}
    assert run_params(spec, num_csx=2) == {
        "num_csx": "2", "global_batch": "8", "seq_len": "32", "lr": "0.01", "seed": "3",
        "algorithm": "rigl", "target_sparsity": "0.9", "init_method": "random",
        "distribution": "erk", "update_freq": "5", "update_stop": "15",
        "drop_fraction_init": "0.3", "drop_fraction_type": "cosine", "model.preset": "tiny"}
    assert run_params({"sparsity": 0.5}, num_csx=1)["algorithm"] == "static"


def test_helpers_round_trip_and_resolve():
    assert flatten_params({"a": {"b": {"c": 1}}, "d": {}}) == {"a.b.c": "1", "d": "{}"}
    mask = torch.tensor([[True, False, True], [False, False, True]])
    assert unpack_masks(pack_masks({"w": mask}))["w"].tolist() == mask.tolist()
    assert resolve_tracking_uri("sqlite:///x.db").startswith("sqlite:////")
    assert block_density(np.ones((1000, 3))).shape == (250, 3)
