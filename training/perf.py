"""Projected CS-2 performance of a (sparse) model, from its live masks, via the simulator's
cost model; shared by the training loop (perf/* metrics) and ``training.report``."""

from __future__ import annotations

from typing import Any

import torch


def project(model: torch.nn.Module, *, seq_len: int, global_tokens: int, num_csx: int,
            dense_grad: bool = False) -> Any:
    """``simulator.cost_model.project_step`` for one step of ``global_tokens`` tokens split over
    ``num_csx`` systems, with the layer shapes and densities read from the model's masks and
    each routed expert computing on the tokens routed to it (``Transformer.token_share``); the
    fused experts' weights, which are no linear layers, counted as the plan counts them."""
    from simulator.cost_model import LayerShape, WaferScaleCluster, layers_from_model, project_step

    share = getattr(model, "token_share", None)
    layers = layers_from_model(model, seq_tokens=seq_len, token_share=share)
    fused = [(name, label, weight) for name, label, weight in model.weight_matrices()
             if weight.dim() == 3] if hasattr(model, "weight_matrices") else []
    for name, label, weight in fused:  # no linear layers: each (out, expert) pair is a row
        mask = getattr(model.get_submodule(name), "expert_weights_mask", None)
        kept = torch.ones_like(weight, dtype=torch.bool) if mask is None else mask.detach().cpu()
        layers.append(LayerShape.from_mask(label, kept.reshape(-1, weight.shape[-1]), share(name)))
    return project_step(layers, global_tokens, WaferScaleCluster(num_csx=num_csx),
                        dense_grad=dense_grad)


def projection_metrics(projection: Any) -> dict[str, float]:
    return {"perf/sim_step_ms": float(projection.step_ms),
            "perf/speedup_vs_dense": float(projection.speedup_vs_dense),
            "perf/scaling_efficiency": float(projection.scaling_efficiency),
            "perf/sim_tokens_per_s": float(projection.metrics()["perf/sim_tokens_per_s"])}


class PerfProjector:
    """perf/sim_step_ms, perf/speedup_vs_dense and perf/scaling_efficiency for the step just
    taken. Masks change only on update steps (in place, bumping ``mask._version``), so the
    projection is recomputed only when a mask version or the dense-gradient need changed."""

    def __init__(self, model: torch.nn.Module, alg: Any, *, seq_len: int, global_tokens: int,
                 num_csx: int) -> None:
        self.model, self.alg = model, alg
        self.seq_len, self.global_tokens, self.num_csx = seq_len, global_tokens, num_csx
        self._key: tuple | None = None
        self._metrics: dict[str, float] = {}

    def metrics(self, dense_grad: bool = False) -> dict[str, float]:
        masks = self.alg.sparse_parameters() if self.alg is not None else []
        key = (tuple(mask._version for _, _, mask in masks), dense_grad)
        if key != self._key:
            self._metrics = projection_metrics(project(
                self.model, seq_len=self.seq_len, global_tokens=self.global_tokens,
                num_csx=self.num_csx, dense_grad=dense_grad))
            self._key = key
        return dict(self._metrics)
