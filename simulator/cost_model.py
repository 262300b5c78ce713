"""Weight-streaming step-time model of a Cerebras CS-2 cluster (docs/design.md §3), as pure functions.

Per layer ℓ with F_ℓ = 6·W_ℓ FLOPs per token (forward 2, backward 4), density d, T tokens per
step over N systems, imbalance factor u_ℓ from the real mask (``simulator.placement``), and
r_ℓ the share of the tokens the layer computes on (top_k / num_experts in a routed expert of a
mixture of experts, 1 elsewhere):

    t_c  = F_ℓ · (d + κ(1 − d)) · u_ℓ · r_ℓ · (T / N) / (η · P) + τ
    B_w  = min(value_bytes · W, (value_bytes + index_bytes) · nnz)    weights, dense or CSR
    B_g  = grad_bytes · nnz   (grad_bytes · W on RigL/GraNet update steps)
    t_io = (2 · B_w + B_g) / BW_io          weights stream in for forward and for backward
    step = Σ_ℓ max(t_c, t_io) + bubble + h · ceil(log_fanout N) + t_sync

Weights are broadcast to every system (SwarmX), so t_io does not shrink with N while t_c does:
that is where scaling efficiency ``t_1 / (N · t_N)`` is lost. Every expert's weights stream in
and its gradients out each step (each receives some of the tokens), so r_ℓ scales compute only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import nn

from simulator.placement import imbalance_factor


@dataclass(frozen=True)
class CS2:
    """Public Cerebras CS-2 / WSE-2 numbers.

    Sources: WSE-2 product page and CS-2 datasheet (cerebras.net/product-chip, /product-system:
    850,000 cores, 40 GB on-chip SRAM (= 48 KB per core), system I/O 1.2 Tb/s over 12×100 GbE
    = 150 GB/s); S. Lie, "Cerebras Architecture Deep Dive", Hot Chips 34 (2022): 4-way FP16
    SIMD FMAC per core, 1.1 GHz; Cerebras Wafer-Scale Cluster announcement (Hot Chips 33, 2021)
    and the weight-streaming white paper: MemoryX + SwarmX broadcast/reduce tree (fan-out 4),
    up to 192 CS-2 systems; Cerebras SDK documentation: 757 × 996 programmable fabric.
    """

    num_pes: int = 850_000
    fmac_lanes_fp16: int = 4
    clock_hz: float = 1.1e9
    sram_bytes_per_pe: int = 48 * 1024
    io_bytes_per_s: float = 150e9
    swarmx_fanout: int = 4
    max_systems: int = 192
    pe_grid_rows: int = 757
    pe_grid_cols: int = 996

    @property
    def peak_flop_per_s(self) -> float:
        """num_pes · lanes · 2 FLOP per FMAC · clock ≈ 7.48e15 FLOP/s."""
        return self.num_pes * self.fmac_lanes_fp16 * 2 * self.clock_hz


@dataclass(frozen=True)
class CostKnobs:
    """Assumed constants of the model (not published; each one is a knob).

    efficiency: η, the fraction of peak a dense layer reaches.
    zero_cost: κ, the cost of a skipped zero relative to a multiply (control, metadata).
    layer_overhead_s: τ, fixed per-layer cost (kernel switch, weight-stream start).
    swarmx_hop_s: h, latency of one SwarmX broadcast/reduce tree level.
    sync_s: t_sync, per-step gradient reduction and MemoryX optimizer hand-off.
    bubble_s: iteration bubble, the pipeline drain at the forward/backward turnaround.
    value_bytes, index_bytes, grad_bytes: FP16 weights, 16-bit CSR indices, FP16 gradients.
    """

    efficiency: float = 0.5
    zero_cost: float = 0.1
    layer_overhead_s: float = 20e-6
    swarmx_hop_s: float = 10e-6
    sync_s: float = 1e-3
    bubble_s: float = 0.5e-3
    value_bytes: int = 2
    index_bytes: int = 2
    grad_bytes: int = 2

    def __post_init__(self) -> None:
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError(f"efficiency must lie in (0, 1], got {self.efficiency}")
        if not 0.0 <= self.zero_cost <= 1.0:
            raise ValueError(f"zero_cost must lie in [0, 1], got {self.zero_cost}")
        for name in ("layer_overhead_s", "swarmx_hop_s", "sync_s", "bubble_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class WaferScaleCluster:
    """N CS-2 systems fed by MemoryX through a SwarmX tree.

    Attributes:
        num_csx: Systems, from 1 to the system's ``max_systems`` (192).
        system: One system's constants (PEs, clock, I/O).
        knobs: The assumed efficiencies and latencies.

    Raises:
        TypeError: `num_csx` is not an int.
        ValueError: `num_csx` outside [1, max_systems].
    """

    num_csx: int = 1
    system: CS2 = field(default_factory=CS2)
    knobs: CostKnobs = field(default_factory=CostKnobs)

    def __post_init__(self) -> None:
        if isinstance(self.num_csx, bool) or not isinstance(self.num_csx, int):
            raise TypeError(f"num_csx must be an int, got {type(self.num_csx).__name__}")
        if not 1 <= self.num_csx <= self.system.max_systems:
            raise ValueError(f"num_csx must lie in [1, {self.system.max_systems}], "
                             f"got {self.num_csx}")

    @property
    def swarmx_levels(self) -> int:
        """ceil(log_fanout N), computed on integers."""
        levels, reach = 0, 1
        while reach < self.num_csx:
            reach *= self.system.swarmx_fanout
            levels += 1
        return levels

    def with_systems(self, num_csx: int) -> "WaferScaleCluster":
        return replace(self, num_csx=num_csx)


@dataclass(frozen=True)
class LayerShape:
    """One matmul of the model: W is (out_features, in_features) at the given density.

    row_nnz: non-zeros per output row from the real mask (None = spread evenly), used for the
    load-imbalance term. streams_weights=False marks activation-only products (attention scores),
    which are dense compute with no weight traffic. token_share: the share of the step's tokens
    the layer computes on (top_k / num_experts for a routed expert; 1 for every other layer).
    """

    name: str
    out_features: int
    in_features: int
    density: float = 1.0
    row_nnz: tuple[int, ...] | None = None
    streams_weights: bool = True
    token_share: float = 1.0

    def __post_init__(self) -> None:
        if self.out_features < 1 or self.in_features < 1:
            raise ValueError(f"{self.name}: out_features and in_features must be >= 1")
        if not 0.0 < self.token_share <= 1.0:
            raise ValueError(f"{self.name}: token_share must lie in (0, 1], got {self.token_share}")
        if not 0.0 <= self.density <= 1.0:
            raise ValueError(f"{self.name}: density must lie in [0, 1], got {self.density}")
        if not self.streams_weights and self.density != 1.0:
            raise ValueError(f"{self.name}: activation-only layers (streams_weights=False) "
                             "are dense; density must be 1.0")
        if self.row_nnz is not None:
            if len(self.row_nnz) != self.out_features:
                raise ValueError(f"{self.name}: row_nnz has {len(self.row_nnz)} entries, "
                                 f"out_features is {self.out_features}")
            if abs(sum(self.row_nnz) - self.density * self.weights) > 0.5:
                raise ValueError(f"{self.name}: row_nnz sums to {sum(self.row_nnz)}, density "
                                 f"{self.density} implies {self.density * self.weights:.0f}")

    @classmethod
    def from_mask(cls, name: str, mask: torch.Tensor, token_share: float = 1.0) -> "LayerShape":
        """A layer from a live (out, in) bool mask; an all-True mask gives the dense shape."""
        out_features, in_features = mask.shape
        row_nnz = mask.sum(1)
        nnz = int(row_nnz.sum())
        if nnz == mask.numel():
            return cls(name, out_features, in_features, token_share=token_share)
        return cls(name, out_features, in_features, nnz / mask.numel(),
                   tuple(int(n) for n in row_nnz.tolist()), token_share=token_share)

    @property
    def weights(self) -> int:
        return self.out_features * self.in_features

    @property
    def nnz(self) -> float:
        return self.density * self.weights

    @property
    def flops_per_token(self) -> int:
        """Forward (2·W) plus backward (dX and dW, 4·W) FLOPs per token at full density."""
        return 6 * self.weights

    def as_dense(self) -> "LayerShape":
        return replace(self, density=1.0, row_nnz=None)


@dataclass(frozen=True)
class LayerProjection:
    name: str
    density: float
    compute_ms: float
    io_ms: float
    bound: Literal["compute", "io"]
    imbalance: float

    @property
    def time_ms(self) -> float:
        return max(self.compute_ms, self.io_ms)


@dataclass(frozen=True)
class StepProjection:
    num_csx: int
    tokens: int
    step_ms: float
    dense_step_ms: float
    single_system_step_ms: float
    overhead_ms: float          # bubble + SwarmX latency + sync
    useful_flops: float         # non-zero FLOPs of the step
    per_layer: tuple[LayerProjection, ...]

    @property
    def speedup_vs_dense(self) -> float:
        return self.dense_step_ms / self.step_ms

    @property
    def scaling_efficiency(self) -> float:
        """t_1 / (N · t_N) for the same global batch: 1 is perfect, lower is lost to I/O."""
        return self.single_system_step_ms / (self.num_csx * self.step_ms)

    @property
    def tflops(self) -> float:
        """Effective TFLOP/s: non-zero FLOPs only, over the projected step time."""
        return self.useful_flops / (self.step_ms * 1e-3) / 1e12

    @property
    def compute_ms(self) -> float:
        return sum(layer.compute_ms for layer in self.per_layer)

    @property
    def io_ms(self) -> float:
        return sum(layer.io_ms for layer in self.per_layer)

    def metrics(self) -> dict[str, float]:
        """Flat MLflow names of docs/design.md §5."""
        return {"perf/sim_step_ms": self.step_ms, "perf/speedup_vs_dense": self.speedup_vs_dense,
                "perf/scaling_efficiency": self.scaling_efficiency,
                "perf/sim_tflops": self.tflops,
                "perf/sim_tokens_per_s": self.tokens / (self.step_ms * 1e-3)}


def project_layer(layer: LayerShape, tokens: int, cluster: WaferScaleCluster,
                  dense_grad: bool = False) -> LayerProjection:
    """Compute and I/O time of one layer for one step (see the module docstring)."""
    knobs, system = cluster.knobs, cluster.system
    work_fraction = layer.density + knobs.zero_cost * (1.0 - layer.density)
    imbalance = imbalance_factor(layer.row_nnz, layer.in_features, system.pe_grid_rows,
                                 knobs.zero_cost)
    compute_s = (layer.flops_per_token * work_fraction * imbalance * layer.token_share * tokens
                 / cluster.num_csx / (knobs.efficiency * system.peak_flop_per_s) + knobs.layer_overhead_s)
    io_s = 0.0
    if layer.streams_weights:
        weight_bytes = min(knobs.value_bytes * layer.weights,
                           (knobs.value_bytes + knobs.index_bytes) * layer.nnz)
        grad_count = layer.weights if dense_grad else layer.nnz
        io_s = (2 * weight_bytes + knobs.grad_bytes * grad_count) / system.io_bytes_per_s
    return LayerProjection(layer.name, layer.density, compute_s * 1e3, io_s * 1e3,
                           "compute" if compute_s >= io_s else "io", imbalance)


def _project_layers(layers: Sequence[LayerShape], tokens: int, cluster: WaferScaleCluster,
                    dense_grad: bool = False) -> tuple[LayerProjection, ...]:
    """project_layer of each layer. Layers without live masks that differ only in their name
    (a planned deep model's repeated blocks, 80 or 120 alike) are projected once; a live mask's
    row counts make its layer its own."""
    projected: dict[tuple, LayerProjection] = {}
    per_layer = []
    for layer in layers:
        if layer.row_nnz is not None:
            per_layer.append(project_layer(layer, tokens, cluster, dense_grad))
            continue
        key = (layer.out_features, layer.in_features, layer.density, layer.streams_weights,
               layer.token_share)
        if key not in projected:
            projected[key] = project_layer(layer, tokens, cluster, dense_grad)
        alike = projected[key]
        per_layer.append(alike if alike.name == layer.name else replace(alike, name=layer.name))
    return tuple(per_layer)


def _step_ms(per_layer: Sequence[LayerProjection], cluster: WaferScaleCluster) -> float:
    knobs = cluster.knobs
    overhead_s = (knobs.bubble_s + knobs.swarmx_hop_s * cluster.swarmx_levels + knobs.sync_s)
    return sum(layer.time_ms for layer in per_layer) + overhead_s * 1e3


def project_step(layers: Sequence[LayerShape], tokens: int, cluster: WaferScaleCluster,
                 dense_grad: bool = False) -> StepProjection:
    """Projected step of `tokens` tokens (global batch) on `cluster`; dense_grad on update steps.

    The formula and its assumed constants are in the guide's "Cost model and its assumptions"
    (docs/benchmarks.md).

    Args:
        layers: The linear layers with their densities, e.g. from
            [`layers_from_model`][simulator.layers_from_model] or
            [`gpt_layer_shapes`][simulator.gpt_layer_shapes].
        tokens: Tokens in the global batch (split evenly over the cluster's systems).
        cluster: The systems, their constants and the cost knobs.
        dense_grad: Stream dense gradients back (RigL/GraNet update steps).

    Returns:
        Step time in milliseconds on `cluster`, on one system and dense, with the speed-up
        and scaling efficiency, and the per-layer terms.

    Raises:
        ValueError: `layers` is empty, or `tokens` is not a positive int.
    """
    if not layers:
        raise ValueError("layers must not be empty")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    per_layer = _project_layers(layers, tokens, cluster, dense_grad)
    step_ms = _step_ms(per_layer, cluster)
    dense_ms = _step_ms(_project_layers([layer.as_dense() for layer in layers], tokens, cluster),
                        cluster)
    single = cluster.with_systems(1)
    single_ms = step_ms if cluster.num_csx == 1 else _step_ms(
        _project_layers(layers, tokens, single, dense_grad), single)
    knobs = cluster.knobs
    return StepProjection(
        num_csx=cluster.num_csx, tokens=tokens, step_ms=step_ms, dense_step_ms=dense_ms,
        single_system_step_ms=single_ms,
        overhead_ms=(knobs.bubble_s + knobs.swarmx_hop_s * cluster.swarmx_levels
                     + knobs.sync_s) * 1e3,
        useful_flops=sum(layer.flops_per_token * layer.density * layer.token_share * tokens
                         for layer in layers),
        per_layer=per_layer)


def gpt_layer_shapes(*, n_layer: int, d_model: int, d_ff: int, vocab_size: int, seq_len: int,
                     density: float) -> list[LayerShape]:
    """GPT-style decoder: QKV, out-proj, FFN at `density`; attention scores and LM head dense."""
    layers: list[LayerShape] = []
    for i in range(n_layer):
        prefix = f"h.{i}"
        layers += [
            LayerShape(f"{prefix}.attn.qkv", 3 * d_model, d_model, density),
            LayerShape(f"{prefix}.attn.scores", 2 * seq_len, d_model, streams_weights=False),
            LayerShape(f"{prefix}.attn.proj", d_model, d_model, density),
            LayerShape(f"{prefix}.mlp.fc1", d_ff, d_model, density),
            LayerShape(f"{prefix}.mlp.fc2", d_model, d_ff, density),
        ]
    layers.append(LayerShape("lm_head", vocab_size, d_model))
    return layers


def attended_keys(seq_tokens: int, window: int | None = None, sink_tokens: int | None = None) -> int:
    """Keys each query's scores are computed against: the sequence, or with a sliding window
    at most the window plus the sink tokens."""
    return seq_tokens if window is None else min(seq_tokens, window + (sink_tokens or 0))


def layers_from_model(model: nn.Module, seq_tokens: int | None = None,
                      token_share: Callable[[str], float] | None = None) -> list[LayerShape]:
    """Every linear layer of `model` with its live `weight_mask` (dense when it has none), and
    with token_share (a module name -> the share of tokens it computes on) each layer's share.

    With seq_tokens (the sequence length), each module whose class name contains "Attention"
    also contributes its QKᵀ and AV products as a dense, activation-only layer
    (2·keys × width: width = num_heads · head_dim where the module has them, else in_features
    of its first linear child; keys = attended_keys with the module's window and sink_tokens).
    """
    from simulator.layers import CSRLinear  # layers does not import this module: no cycle

    layers: list[LayerShape] = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, CSRLinear)):
            mask = getattr(module, "weight_mask", None)
            label = f"{name}.weight" if name else "weight"
            share = token_share(name) if token_share is not None else 1.0
            if mask is None:
                layers.append(LayerShape(label, module.out_features, module.in_features,
                                         token_share=share))
            else:
                layers.append(LayerShape.from_mask(label, mask.detach().cpu(), share))
        elif seq_tokens is not None and "attention" in type(module).__name__.lower():
            width = next((child.in_features for child in module.modules()
                          if isinstance(child, (nn.Linear, CSRLinear))), None)
            if hasattr(module, "num_heads") and hasattr(module, "head_dim"):
                width = module.num_heads * module.head_dim  # narrower than the stream: attention_inner_dim
            if width is not None:
                keys = attended_keys(seq_tokens, getattr(module, "window", None), getattr(module, "sink_tokens", None))
                layers.append(LayerShape(f"{name}.scores", 2 * keys, width, streams_weights=False))
    if not layers:
        raise ValueError("model has no linear layers to project")
    return layers
