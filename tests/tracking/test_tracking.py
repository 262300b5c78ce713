"""Tracker: batched metrics, mask artifacts, nested runs, params, run lifecycle."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import json
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mlflow import MlflowClient
from PIL import Image

from tracking.plots import (
    HeatmapWriter,
    axes_hold_data,
    block_density,
    curves_figure,
    plain_tick_labels,
    save_figure,
    tradeoff_figure,
)
from tracking.tracker import (
    LAYER_NAMES_FILE,
    PARENT_RUN_TAG,
    Tracker,
    cli_run_name,
    create_run,
    describe_lr_schedule,
    end_run,
    flatten_params,
    job_params,
    layer_display_names,
    pack_masks,
    resolve_tracking_uri,
    run_params,
    unpack_masks,
)
from training.plan import plan_job


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

    assert batch_sizes == [1000, 401]  # 1400 points, then final/train_loss at finish
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


def test_text_is_logged_at_its_artifact_path(tracking_uri):
    tracker = Tracker("exp", tracking_uri=tracking_uri)
    tracker.log_text("train_input:\n  batch_size: 8\n", "config/params.yaml")
    tracker.log_text("{}", "top.json")
    artifacts = artifact_dir(tracker.client, tracker.run_id)
    assert (artifacts / "config" / "params.yaml").read_text() == "train_input:\n  batch_size: 8\n"
    assert (artifacts / "top.json").read_text() == "{}"
    assert not list((tracker.spool / "artifacts").iterdir())  # sent, so not kept


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


def test_lr_schedule_is_one_line_per_phase_without_unset_keys():
    schedule = [{"scheduler": "Linear", "initial_learning_rate": 0.0, "end_learning_rate": 6e-4,
                 "total_iters": 716, "decay_rate": None},
                {"scheduler": "CosineDecay", "initial_learning_rate": 6e-4,
                 "end_learning_rate": 6e-5, "total_iters": 4062, "power": None},
                {"scheduler": "Constant", "learning_rate": 6e-5}]
    assert describe_lr_schedule(schedule) == [
        "steps 0-715: Linear 0 -> 0.0006", "steps 716-4777: CosineDecay 0.0006 -> 6e-05",
        "from step 4778: Constant 6e-05"]
    # a phase of unknown length: the next one's start is unknown too
    assert describe_lr_schedule([{"scheduler": "Exponential", "initial_learning_rate": 0.1,
                                  "decay_rate": 0.5, "step_size": None},
                                 {"scheduler": "Constant", "learning_rate": 0.01}]) == [
        "from step 0: Exponential 0.1 (decay_rate=0.5)", "Constant 0.01"]
    params = run_params({"optimizer": {"learning_rate": schedule[:2]}}, num_csx=1)
    assert params["optimizer.learning_rate.phase1"] == "steps 0-715: Linear 0 -> 0.0006"
    assert params["lr"] == ("steps 0-715: Linear 0 -> 0.0006; then steps 716-4777: "
                            "CosineDecay 0.0006 -> 6e-05")
    assert not [v for k, v in params.items() if "learning_rate" in k and "None" in v]


def test_job_params_hold_the_model_as_built():
    """A preset fills the sizes the file leaves out; the params say what was built."""
    from training.plan import model_config
    from training.data import planned_shapes
    from csx_config import JobSpec

    spec = JobSpec.from_yaml("model: {preset: mini, num_hidden_layers: 3}\n"
                             "train_input: {batch_size: 4, max_sequence_length: 16}\n")
    built = model_config(spec, *planned_shapes(spec))
    params = job_params(plan_job(spec, 2))
    assert (built.hidden_size, built.num_hidden_layers, built.vocab_size) == (128, 3, 256)
    for key in ("hidden_size", "num_hidden_layers", "num_heads", "filter_size", "vocab_size",
                "norm_type", "position_embedding_type", "max_position_embeddings"):
        assert params[f"model.{key}"] == str(getattr(built, key)), key
    assert params["model.preset"] == "mini" and params["num_csx"] == "2"


def test_cli_run_names_differ_per_params_file():
    assert cli_run_name("examples/rigl.yaml", "rigl") == "rigl"
    assert cli_run_name("/x/params_gpt3_125m_rigl75.yaml", "rigl") == "params_gpt3_125m_rigl75"
    assert cli_run_name("ablation-3.yaml", "rigl") == "ablation-3 (rigl)"
    assert cli_run_name("a.yaml", "set") != cli_run_name("b.yaml", "set")


@pytest.mark.slow
def test_one_and_two_system_runs_are_recorded_alike(tmp_path, monkeypatch, capsys, ray_session):
    """`csx run` on 1 system and on 2 (the same worker group): the same tags, params and summary
    keys, `csx.num_csx` and `num_csx` saying which, and each run named after its file."""
    import json

    from csx import cli

    store = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    summaries = {}
    for name, num_csx in (("first", 1), ("second", 2)):
        params = tmp_path / f"{name}.yaml"
        params.write_text("train_input: {batch_size: 4, max_sequence_length: 16}\n"
                          "eval_input: {batch_size: 4, max_sequence_length: 16}\n"
                          "model: {preset: tiny}\n"
                          "sparsity: {algorithm: set, sparsity: 0.5, update: {freq: 2}}\n"
                          "runconfig: {max_steps: 2, log_steps: 1, eval_steps: 1, eval_frequency: 2, "
                          "checkpoint_steps: 0, mlflow_experiment: recorded-alike}\n")
        assert cli.main(["run", "--params", str(params), "--num_csx", str(num_csx),
                         "--mode", "train_and_eval", "--model_dir", str(tmp_path / name)]) == 0
        summaries[name] = json.loads(capsys.readouterr().out)
    assert summaries["first"].keys() == summaries["second"].keys()
    assert [summaries[n]["num_csx"] for n in ("first", "second")] == [1, 2]
    client = MlflowClient(f"sqlite:///{store}")
    runs = {name: client.get_run(summaries[name]["run_id"]) for name in summaries}
    assert [runs[n].info.run_name for n in ("first", "second")] == ["first (set)", "second (set)"]
    tags = {n: {k: v for k, v in r.data.tags.items() if k.startswith("csx.")}
            for n, r in runs.items()}
    assert tags["first"].keys() == tags["second"].keys() >= {
        "csx.algorithm", "csx.variant", "csx.num_csx", "csx.params_file"}
    assert (tags["first"]["csx.num_csx"], tags["second"]["csx.params_file"]) == ("1", "second.yaml")
    assert runs["first"].data.params.keys() == runs["second"].data.params.keys()
    assert runs["second"].data.params["num_csx"] == "2"
    metric_keys = {n: set(r.data.metrics) for n, r in runs.items()}
    assert metric_keys["first"] == metric_keys["second"] and "eval/perplexity" in metric_keys["first"]


def test_tradeoff_axis_has_no_offset_and_does_not_stretch_tiny_differences():
    """Speed-ups 5e-5 apart (an overhead-bound proxy) read as 1.00 for all, not "1e-5+1"."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    speedups = [1.00001, 1.00004, 1.00006]
    figure = tradeoff_figure([(name, s, 7.0 + i, "C0") for i, (name, s) in
                              enumerate(zip(("static", "set", "rigl"), speedups))], title="t")
    FigureCanvasAgg(figure).draw()
    axes = figure.axes[0]
    low, high = axes.get_xlim()
    assert high - low >= 0.1 and low < min(speedups) and max(speedups) < high
    for axis in (axes.xaxis, axes.yaxis):
        assert axis.get_offset_text().get_text() == ""
        labels = [t.get_text().replace("\u2212", "-") for t in axis.get_ticklabels() if t.get_text()]
        assert labels and all(abs(float(label)) < 100 for label in labels)
    spread = tradeoff_figure([("a", 1.5, 7.0, "C0"), ("b", 2.5, 7.1, "C1")], title="t")
    assert spread.axes[0].get_xlim()[1] - spread.axes[0].get_xlim()[0] == pytest.approx(1.1)


def test_plain_tick_labels_on_values_near_a_large_constant():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure()
    axes = figure.add_subplot()
    axes.plot([0, 1, 2], [0.79690, 0.79695, 0.79700])
    plain_tick_labels(axes)
    FigureCanvasAgg(figure).draw()
    assert axes.yaxis.get_offset_text().get_text() == ""
    assert all(t.get_text().startswith("0.79") for t in axes.yaxis.get_ticklabels() if t.get_text())


def test_experiments_open_on_their_runs_in_mlflow_3(tracking_uri):
    """MLflow 3 opens an experiment without a kind on its GenAI overview (traces: 0)."""
    client = MlflowClient(tracking_uri)
    tracker = Tracker("kind-new", tracking_uri=tracking_uri)
    old = client.create_experiment("kind-old")  # made by someone else, without the tag
    Tracker("kind-old", tracking_uri=tracking_uri)
    for experiment_id in (client.get_run(tracker.run_id).info.experiment_id, old):
        tags = client.get_experiment(experiment_id).tags
        assert tags["mlflow.experimentKind"] == "custom_model_development"


def test_a_finished_run_logs_its_final_values_once_as_bar_metrics(tracking_uri):
    tracker = Tracker("final", tracking_uri=tracking_uri)
    for step, ppl in ((10, 20.0), (20, 9.5), (30, 7.25)):
        tracker.log_metrics({"eval/perplexity": ppl, "train/loss": 1.0 / step}, step=step)
    tracker.finish()
    history = tracker.client.get_metric_history(tracker.run_id, "final/eval_perplexity")
    assert [(m.step, m.value) for m in history] == [(30, 7.25)]
    assert tracker.client.get_run(tracker.run_id).data.metrics["final/train_loss"] == 1.0 / 30
    assert "final/eval_loss" not in tracker.client.get_run(tracker.run_id).data.metrics
    failed = Tracker("final", tracking_uri=tracking_uri)
    failed.log_metrics({"eval/perplexity": 9.0}, step=5)
    failed.finish("FAILED")  # a failed run has no final value to compare
    assert "final/eval_perplexity" not in failed.client.get_run(failed.run_id).data.metrics


LAYERS = [f"transformer_decoder.layers.{i}.{part}.weight" for i in (0, 11) for part in (
    "self_attn.proj_q_dense_layer", "self_attn.proj_output_dense_layer",
    "ffn.ffn.0.linear_layer_for_glu", "ffn.ffn.0.linear_layer", "ffn.ffn.1.linear_layer")]


def test_layer_levels_are_charted_after_the_headline_sections_under_short_names(tracking_uri):
    """MLflow 3 sections charts by the name up to its last "/" and sorts the sections as plain
    strings: every per-layer chart must sort after every headline one, target apart from
    actual, with a title that fits a chart card; layer_names.json maps the titles back."""
    tracker = Tracker("layers", tracking_uri=tracking_uri)
    levels = {f"sparsity/{name}/{kind}": 0.8 for name in LAYERS for kind in ("target", "actual")}
    headline = {"eval/perplexity": 9.0, "train/loss": 2.0, "sparsity/global": 0.8,
                "perf/sim_step_ms": 1.0, "mask/churn": 0.1}
    tracker.log_metrics({**levels, **headline}, step=0)
    tracker.log_metrics(levels, step=5)
    tracker.finish()
    logged = set(tracker.client.get_run(tracker.run_id).data.metrics)
    assert not [key for key in logged if key.startswith("sparsity/transformer_decoder")]
    sections = {key.rpartition("/")[0] for key in logged}
    per_layer = {key.rpartition("/")[0] for key in logged if key.startswith("weights/")}
    assert per_layer == {"weights/sparsity", "weights/target"}
    assert max(sections - per_layer) < min(per_layer), sorted(sections)
    assert "weights/sparsity/L11.attn.q" in logged and "weights/target/L00.ffn0.glu" in logged
    assert max(len(key) for key in logged if key.startswith("weights/")) <= 32
    assert len(tracker.history("weights/sparsity/L00.ffn1")) == 2  # one point per step
    mapping = json.loads(Path(tracker.client.download_artifacts(
        tracker.run_id, LAYER_NAMES_FILE)).read_text())
    assert sorted(mapping.values()) == sorted(LAYERS)
    assert {f"weights/sparsity/{short}" for short in mapping} <= logged


def test_a_retry_charts_the_layers_under_the_same_names(tracking_uri):
    first = Tracker("layers", tracking_uri=tracking_uri)
    first.log_metrics({f"sparsity/{LAYERS[0]}/actual": 0.5}, step=0)
    first.flush()
    retry = Tracker("layers", run_id=first.run_id, tracking_uri=tracking_uri)
    retry.log_metrics({f"sparsity/{LAYERS[0]}/actual": 0.7}, step=0)  # a step it re-runs
    retry.log_metrics({f"sparsity/{LAYERS[0]}/actual": 0.8}, step=5)
    retry.flush()
    history = retry.client.get_metric_history(first.run_id, "weights/sparsity/L00.attn.q")
    assert [(m.step, m.value) for m in history] == [(0, 0.5), (5, 0.8)]


PARTS = st.sampled_from(["transformer_decoder", "layers", "0", "3", "03", "L03", "self_attn",
                         "proj_q_dense_layer", "attn", "q", "ffn", "ffn0", "linear_layer",
                         "linear_layer_for_glu", "glu", "weight", "experts", "expert0", "2"])


@given(st.sets(st.lists(PARTS, min_size=1, max_size=6).map(".".join), max_size=12))
def test_layer_display_names_never_merge_two_layers(names):
    shown = layer_display_names(names)
    assert set(shown) == names
    assert len(set(shown.values())) == len(names)
    assert all(re.fullmatch(r"[\w.]+", name) for name in shown.values())
