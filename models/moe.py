"""Mixture of experts in place of the FFN (Mixtral, ModelZoo's ``model.moe``): the router, the
experts in the parameter layout of the file's release, and the load-balancing loss.

ModelZoo names the experts by ``moe_implementation`` (csx_config.layouts fills in the default
of the file's release), so a sparsity filter selects the matrices it selects there:

    optimized (fused; the default up to 2.5)   ffn.experts.fused_ffns.{i}.linear_layer.expert_weights
                                               (out, experts + shared, in), linear_layer_for_glu too
    experimental (the default from 2.6)        ffn.experts.experts.{e}.{i}.linear_layer.weight,
                                               shared: ffn.experts.shared_experts.{s}.ffn.{i}...
    functional (also forge_experimental,       ffn.experts.experts.{e}.ffn.{i}.linear_layer.weight,
    expert_parallel)                           routed experts first, then the shared ones

``i`` is the FFN layer (0: hidden -> filter, 1: filter -> hidden). All three compute the same
function of the same weights.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.ffn import ACTIVATIONS, GLU_ACTIVATIONS, FeedForwardNetwork, feed_forward_layers

# Parameter name -> (decoder layer, the experts container's attribute and expert index).
EXPERT_PARAMETER = re.compile(r"transformer_decoder\.layers\.(\d+)\.ffn\.experts\.(experts|shared_experts)\.(\d+)\.")
FUSED_PARAMETER = re.compile(r"transformer_decoder\.layers\.(\d+)\.ffn\.experts\.fused_ffns\.")


class FunctionalExperts(nn.Module):
    """``experts.{e}``: a whole FFN each, the routed experts first, then the shared ones."""

    def __init__(self, config: ModelConfig, routed: int, shared: int) -> None:
        super().__init__()
        self.routed = routed
        self.experts = nn.ModuleList(FeedForwardNetwork(config) for _ in range(routed + shared))

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            out = out + (weights[..., index, None] if index < self.routed else 1.0) * expert(x)
        return out

    def expert_label(self, attribute: str, index: int) -> str:
        return f"expert{index}" if index < self.routed else f"shared{index - self.routed}"


class PerExpertExperts(nn.Module):
    """``experts.{e}.{i}``: each routed expert's two FFN layers; ``shared_experts.{s}`` whole
    FFNs (ModelZoo's SparseActFeedForwardNetwork)."""

    def __init__(self, config: ModelConfig, routed: int, shared: int) -> None:
        super().__init__()
        self.routed = routed
        self.experts = nn.ModuleList(feed_forward_layers(config) for _ in range(routed))
        self.shared_experts = nn.ModuleList(FeedForwardNetwork(config) for _ in range(shared))

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in self.shared_experts:
            out = out + expert(x)
        for index, layers in enumerate(self.experts):
            out = out + weights[..., index, None] * layers[1](layers[0](x))
        return out

    def expert_label(self, attribute: str, index: int) -> str:
        return f"expert{index}" if attribute == "experts" else f"shared{index}"


class ExpertsLinear(nn.Module):
    """One linear layer of every expert in one tensor (ModelZoo's TopKExpertsSparseLinear):
    ``expert_weights`` (out, experts, in) and ``expert_biases`` (out, experts, 1); input and
    output (..., experts, features)."""

    def __init__(self, experts: int, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.experts = in_features, out_features, experts
        self.expert_weights = nn.Parameter(torch.empty(out_features, experts, in_features))
        self.expert_biases = nn.Parameter(torch.empty(out_features, experts, 1)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.einsum("...ei,oei->...eo", x, self.expert_weights)
        return y if self.expert_biases is None else y + self.expert_biases[..., 0].T


class FusedLayer(nn.Module):
    """ModelZoo's TopKExpertsSparseSingleFeedForwardLayer: the FFN layer ``i`` of every expert."""

    def __init__(self, experts: int, in_features: int, out_features: int, bias: bool,
                 activation: str | None) -> None:
        super().__init__()
        self.activation = activation
        self.linear_layer = ExpertsLinear(experts, in_features, out_features, bias)
        if activation in GLU_ACTIVATIONS:
            self.linear_layer_for_glu = ExpertsLinear(experts, in_features, out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_layer(x)
        if self.activation in GLU_ACTIVATIONS:
            return GLU_ACTIVATIONS[self.activation](y) * self.linear_layer_for_glu(x)
        return ACTIVATIONS[self.activation](y) if self.activation else y


class FusedExperts(nn.Module):
    """``fused_ffns.{i}``: FFN layer ``i`` of all experts (routed, then shared) fused
    (ModelZoo's TopKExpertsSparseFeedForwardNetwork, the ``optimized`` implementation). Here
    every expert computes every token (masked dense on the CPU), weighted as the others."""

    def __init__(self, config: ModelConfig, routed: int, shared: int) -> None:
        super().__init__()
        self.routed, total, bias = routed, routed + shared, config.use_ffn_bias
        self.fused_ffns = nn.ModuleList([
            FusedLayer(total, config.hidden_size, config.filter_size, bias, config.nonlinearity),
            FusedLayer(total, config.filter_size, config.hidden_size, bias, None)])

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        shared = self.fused_ffns[0].linear_layer.experts - self.routed
        weights = torch.cat([weights, weights.new_ones(*weights.shape[:-1], shared)], -1)
        y = x.unsqueeze(-2).expand(*x.shape[:-1], weights.shape[-1], x.shape[-1])
        for layer in self.fused_ffns:
            y = layer(y)
        return (weights.unsqueeze(-1) * y).sum(-2)

    def expert_label(self, attribute: str, index: int) -> str:
        return f"expert{index}" if index < self.routed else f"shared{index - self.routed}"


LAYOUTS: dict[str, type[nn.Module]] = {
    "optimized": FusedExperts, "experimental": PerExpertExperts, "functional": FunctionalExperts,
    "forge_experimental": FunctionalExperts, "expert_parallel": FunctionalExperts}


class SparseMoEBlock(nn.Module):
    """A mixture of experts in place of the FFN (Mixtral; Shazeer et al. 2017): a learned router
    (``gate``, kept dense) sends each token to its ``top_k`` experts by softmax probability and
    sums their outputs weighted by those probabilities (renormalised over the chosen k, plus
    ``null_expert_bias`` when given); shared experts see every token with weight 1. Each forward
    keeps the router probabilities and the 0/1 choice of every token (``routing``) for the
    load-balancing loss and the router-load metrics."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe or {}
        self.num_experts, self.top_k = moe.get("num_experts", 1), moe.get("top_k", 1)
        self.router_fp32 = moe.get("router_fp32", True)
        self.normalize = moe.get("expert_weighting_normalization", True)
        self.null_expert_bias = moe.get("null_expert_bias") or 0.0
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.gate.weight.requires_dense = True  # the router stays dense under any sparsity filter
        layout = LAYOUTS[config.moe_implementation]
        self.experts = layout(config, self.num_experts, moe.get("num_shared_experts") or 0)
        self.routing: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.router_fp32:  # in float32 even under autocast, which would run the gate in 16 bits
            with torch.autocast(x.device.type, enabled=False):
                logits = F.linear(x.float(), self.gate.weight.float())
        else:
            logits = self.gate(x)
        probs = logits.softmax(-1)
        top_probs, top_index = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            top_probs = top_probs / (top_probs.sum(-1, keepdim=True) + self.null_expert_bias)
        chosen = F.one_hot(top_index, self.num_experts).to(probs.dtype)  # (B, T, k, E)
        weights = (top_probs.unsqueeze(-1) * chosen).sum(-2).to(x.dtype)  # (B, T, E), 0 where not chosen
        self.routing = (probs, chosen.sum(-2))
        return self.experts(x, weights)

    def routed_parameters(self) -> int:
        """The parameters of the routed experts (a token uses top_k of num_experts of them)."""
        experts = self.experts
        if isinstance(experts, FusedExperts):
            total = sum(p.numel() for p in experts.parameters())
            return total * experts.routed // experts.fused_ffns[0].linear_layer.experts
        return sum(p.numel() for expert in list(experts.experts)[:experts.routed] for p in expert.parameters())


def expert_parts(model: nn.Module, name: str) -> list[tuple[int, str, Any]]:
    """The experts a parameter of ``model`` (a Transformer) belongs to: (decoder layer, label
    ``expert<e>`` or ``shared<s>``, the index of that expert's slice of the tensor, or None
    for all of it); [] outside the experts."""
    if (match := EXPERT_PARAMETER.match(name)) is not None:
        experts = model.transformer_decoder.layers[int(match[1])].ffn.experts
        return [(int(match[1]), experts.expert_label(match[2], int(match[3])), None)]
    if (match := FUSED_PARAMETER.match(name)) is not None:
        experts = model.transformer_decoder.layers[int(match[1])].ffn.experts
        count = experts.fused_ffns[0].linear_layer.experts
        return [(int(match[1]), experts.expert_label("fused", index), (slice(None), index)) for index in range(count)]
    return []


def load_balancing_loss(routings: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """ModelZoo's LoadBalancingLoss (Switch Transformer's, Fedus et al. 2021, for top-k): per
    sequence, the share of tokens sent to each expert and its mean router probability, each
    averaged over the MoE layers; E² times the mean of their product (1 when perfectly even
    with k = 1)."""
    experts = routings[0][0].shape[-1]
    tokens = torch.stack([chosen.mean(1) for _, chosen in routings]).mean(0)  # (B, E)
    probs = torch.stack([probs.mean(1) for probs, _ in routings]).mean(0)
    return experts ** 2 * (tokens * probs).mean()
