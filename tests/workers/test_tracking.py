"""Tracker: batched metrics, mask artifacts, nested runs, params, run lifecycle."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from PIL import Image

from workers.plots import (
    HeatmapWriter,
    axes_hold_data,
    block_density,
    curves_figure,
    save_figure,
)
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
    # readable on screen whatever the layer's size, not one pixel per weight
    with Image.open(folder / "heatmap_layers_0_attn_q_proj_weight.png") as image:
        assert image.size[0] >= 480 and image.size[1] >= 400


def test_heatmap_names_layer_step_density_axes_and_downsamples_big_layers(tmp_path):
    mask = np.zeros((600, 40), dtype=bool)
    mask[:300] = True  # top half kept: density 50%
    HeatmapWriter().write(mask, tmp_path / "h.png", name="layers.0.mlp.up_proj.weight", step=7)
    with Image.open(tmp_path / "h.png") as image:
        assert image.text == {"Title": "layers.0.mlp.up_proj.weight",
                              "Description": "step 7, density 50.0% (600x40, blocks of 3x1)"}
        pixels = np.asarray(image.convert("RGB"))
    left, top, right, bottom = HeatmapWriter.PLOT
    kept, pruned = pixels[top + 20, (left + right) // 2], pixels[bottom - 20, (left + right) // 2]
    # rows run top to bottom: the kept top half is viridis' yellow, the pruned half its purple
    assert kept[0] > 200 and kept[2] < 100 and pruned[2] > pruned[1]
    assert block_density(mask).shape == (200, 40)  # at most 256 cells per side


def test_figures_with_an_empty_panel_are_refused(tmp_path):
    only_ppl = curves_figure({"rigl eval/perplexity": [(1, 30.0), (2, 20.0)]})
    assert [a.get_ylabel() for a in only_ppl.axes] == ["perplexity"]  # no empty loss panel
    assert all(axes_hold_data(a) for a in only_ppl.axes)
    figure = curves_figure({"train/loss": [(1, 3.0)], "eval/perplexity": [(1, 20.0)]})
    figure.axes[0].lines[0].set_data([], [])
    with pytest.raises(ValueError, match="'loss' holds no data"):
        save_figure(figure, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_a_step_is_logged_once_even_across_a_retry(tracking_uri):
    tracker = Tracker("exp", tracking_uri=tracking_uri)
    tracker.log_metrics({"sparsity/global": 0.8, "mask/churn": 0.1}, step=5)
    tracker.log_metrics({"sparsity/global": 0.8, "train/loss": 2.0}, step=5)
    tracker.log_metrics({"sparsity/global": 0.8}, step=6)
    tracker.flush()
    retry = Tracker("exp", run_id=tracker.run_id, tracking_uri=tracking_uri)
    retry.log_metrics({"sparsity/global": 0.8, "train/loss": 1.9}, step=6)
    retry.log_metrics({"sparsity/global": 0.7}, step=7)
    retry.finish()
    history = retry.client.get_metric_history(tracker.run_id, "sparsity/global")
    assert sorted(m.step for m in history) == [5, 6, 7]
    assert sorted(m.step for m in retry.client.get_metric_history(
        tracker.run_id, "train/loss")) == [5, 6]
    assert retry.history("sparsity/global") == [(5, 0.8), (6, 0.8), (7, 0.7)]


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
    params = run_params(spec, num_csx=2)
    assert {k: v for k, v in params.items() if "." not in k} == {
        "num_csx": "2", "global_batch": "8", "seq_len": "32", "lr": "0.01", "seed": "3",
        "algorithm": "rigl", "target_sparsity": "0.9", "init_method": "random",
        "distribution": "erk", "update_freq": "5", "update_stop": "15",
        "drop_fraction_init": "0.3", "drop_fraction_type": "cosine"}
    assert params["model.preset"] == "tiny" and params["runconfig.seed"] == "3"
    assert run_params({"sparsity": 0.5}, num_csx=1)["algorithm"] == "static"


def test_run_params_hold_every_section_so_variants_differ_by_params():
    granet = {"optimizer": {"type": "AdamW", "weight_decay": 0.1},
              "runconfig": {"max_steps": 40, "seed": 0},
              "sparsity": {"algorithm": "granet", "sparsity": 0.8, "init_sparsity": 0.5,
                           "drop_fraction": {"type": "cosine", "init": 0.3, "half_period": 30}}}
    params = run_params(granet, num_csx=1)
    assert params["sparsity.init_sparsity"] == "0.5"
    assert params["sparsity.drop_fraction.half_period"] == "30"
    assert params["runconfig.max_steps"] == "40" and params["optimizer.weight_decay"] == "0.1"
    legacy = run_params({"sparsity": {"type": "set", "param_name_patterns": {
        "(attn|mlp).*weight": {"sparsity": 0.9}}}}, num_csx=1)
    # regex keys are no valid MLflow param names: the mapping stays one value
    assert legacy["sparsity.param_name_patterns"] == "{'(attn|mlp).*weight': {'sparsity': 0.9}}"
    assert run_params({"sparsity": 0.5}, num_csx=1)["sparsity"] == "0.5"
    groups = run_params({"sparsity": [{"algorithm": "set", "sparsity": 0.5}]}, num_csx=1)
    assert groups["sparsity.group0.algorithm"] == "set" and groups["algorithm"] == "set"


def test_helpers_round_trip_and_resolve():
    assert flatten_params({"a": {"b": {"c": 1}}, "d": {}}) == {"a.b.c": "1", "d": "{}"}
    mask = torch.tensor([[True, False, True], [False, False, True]])
    assert unpack_masks(pack_masks({"w": mask}))["w"].tolist() == mask.tolist()
    assert resolve_tracking_uri("sqlite:///x.db").startswith("sqlite:////")
    assert block_density(np.ones((1000, 3))).shape == (250, 3)  # blocks of 4 rows
