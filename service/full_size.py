"""A study that trains a scaled-down proxy (its params file plus `overrides`) projected onto the
full-size model: each variant's CS-2 step time and speed-up vs dense at its trained per-layer
densities, on 1, 4 and 16 systems. The trained proxy itself is usually too small for sparsity to
show on a wafer (fixed per-layer latency and sync dominate its step)."""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from typing import Any, Sequence

from service.models import Study
from service.schemas import StudyProjection

FULL_SIZE_SYSTEMS = (1, 4, 16)
# study id -> (full-size layers, tokens per step, model description): the plan of a large model
# takes seconds to build and never changes for a study
_LAYERS: dict[int, tuple[list[Any], int, str]] = {}


def layer_role(name: str) -> str:
    """A layer's name with block indices wildcarded: `...layers.7.ffn.ffn.0.linear_layer.weight`
    and `...layers.0.ffn.ffn.0.linear_layer.weight` play the same role in models of any depth."""
    return re.sub(r"\.\d+\.", ".*.", name)


def full_size_projection(trained: dict[str, dict[str, float]], full_layers: Sequence[Any],
                         tokens: int, model: str,
                         systems: Sequence[int] = FULL_SIZE_SYSTEMS) -> list[StudyProjection]:
    """Each variant's projected CS-2 step time and speed-up vs dense for the full-size model
    whose dense layers (`simulator.cost_model.LayerShape`) are `full_layers`, on each number of
    systems. `trained` maps a variant to the final density of each layer of the trained
    proxy; a full-size layer takes the mean density of the proxy layers in the same role
    (`layer_role`), so GraNet's uneven per-layer levels carry over. Layers no proxy layer
    matches (the proxy kept them dense) stay dense; `model` says which model this is."""
    from dataclasses import replace

    from simulator.cost_model import WaferScaleCluster, project_step

    projections = []
    for variant, densities in trained.items():
        by_role: dict[str, list[float]] = defaultdict(list)
        for name, density in densities.items():
            by_role[layer_role(name)].append(density)
        layers = [replace(layer, density=statistics.fmean(by_role[layer_role(layer.name)]),
                          row_nnz=None)
                  if layer.streams_weights and layer_role(layer.name) in by_role else layer
                  for layer in full_layers]
        for num_csx in systems:
            step = project_step(layers, tokens, WaferScaleCluster(num_csx=num_csx))
            projections.append(StudyProjection(
                variant=variant, model=model, num_csx=num_csx, step_ms=step.step_ms,
                speedup_vs_dense=step.speedup_vs_dense))
    return projections


def full_size_layers(params: dict[str, Any]) -> tuple[list[Any], int, str]:
    """(dense layers, tokens per step, description) of the model `params` describes, from its
    plan (built on the meta device: any size, no memory); attention scores included."""
    from simulator.cost_model import LayerShape, attended_keys
    from csx_config import JobSpec
    from training.plan import plan_job
    from training.report import plan_report

    plan = plan_report(plan_job(JobSpec.model_validate({**params, "sparsity": None}), 1))
    model = plan["model"]
    # A fused experts' weight (out, experts, in) is a matrix of out * experts rows.
    layers = [LayerShape(layer["name"].removesuffix(" (tied)"), layer["numel"] // layer["shape"][-1],
                         layer["shape"][-1], token_share=layer["token_share"]) for layer in plan["layers"]]
    keys = attended_keys(plan["seq_len"], model["attention_sliding_window_length"], model["attention_sink_tokens"])
    width = model["attention_inner_dim"] or model["hidden_size"]
    layers += [LayerShape(f"attention.{i}.scores", 2 * keys, width, streams_weights=False)
               for i in range(model["num_hidden_layers"])]
    description = (f"full size: {model['num_hidden_layers']} layers, hidden_size "
                   f"{model['hidden_size']}, {model['parameters'] / 1e6:,.0f}M parameters, "
                   f"{plan['tokens_per_step']:,} tokens per step (the params without overrides)")
    return layers, plan["tokens_per_step"], description


def trained_densities(study: Study) -> dict[str, dict[str, float]]:
    """Per variant, each sparse layer's final density averaged over the variant's finished
    seeds (a dense variant maps to {}); variants with no finished job are left out."""
    per_layer: dict[str, dict[str, list[float]]] = {}
    for job in study.jobs:
        result = job.result or {}
        if result.get("final_eval_perplexity") is None:
            continue
        layers = per_layer.setdefault(job.tags.get("csx.variant", job.name), {})
        for name, density in (result.get("layer_density") or {}).items():
            layers.setdefault(name, []).append(density)
    return {variant: {name: statistics.fmean(values) for name, values in layers.items()}
            for variant, layers in per_layer.items()}


def full_size_request(body: dict[str, Any]) -> dict[str, Any]:
    """What a study stores besides its validated request: with `overrides`, the params as sent,
    before the overrides scaled them down (the validated request holds the proxy's)."""
    return {"full_size_params": body["params"]} if body.get("overrides") else {}


def full_size_report(study: Study) -> list[StudyProjection]:
    """The projection for a study whose body scales its params down with `overrides` (the
    full-size model is the params without them); [] for any other study, before any variant
    has finished, or when the full-size params build no plan (the report still answers)."""
    params = (study.request or {}).get("full_size_params")
    trained = trained_densities(study)
    if params is None or not trained:
        return []
    if study.id not in _LAYERS:
        try:
            _LAYERS[study.id] = full_size_layers(params)
        except ValueError:  # pydantic's ValidationError included
            return []
    layers, tokens, model = _LAYERS[study.id]
    return full_size_projection(trained, layers, tokens, model)
