"""Mixture of experts in place of the FFN (Mixtral, ModelZoo's ``model.moe``): the router, the
experts, and the load-balancing loss."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.ffn import FeedForwardNetwork

ROUTED_EXPERT = re.compile(r"transformer_decoder\.layers\.(\d+)\.ffn\.experts\.experts\.(\d+)\.")


class ExpertsFeedForwardNetwork(nn.Module):
    """ModelZoo's functional experts: ``experts.{e}`` is a whole FFN (routed experts first, then
    the shared ones), so a sparsity filter on ``*linear_layer.weight`` gives every expert its own
    masks."""

    def __init__(self, config: ModelConfig, count: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(FeedForwardNetwork(config) for _ in range(count))


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
        self.experts = ExpertsFeedForwardNetwork(config, self.num_experts + (moe.get("num_shared_experts") or 0))
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
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts.experts):
            weight = weights[..., index, None] if index < self.num_experts else 1.0
            out = out + weight * expert(x)
        return out


def load_balancing_loss(routings: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """ModelZoo's LoadBalancingLoss (Switch Transformer's, Fedus et al. 2021, for top-k): per
    sequence, the share of tokens sent to each expert and its mean router probability, each
    averaged over the MoE layers; E² times the mean of their product (1 when perfectly even
    with k = 1)."""
    experts = routings[0][0].shape[-1]
    tokens = torch.stack([chosen.mean(1) for _, chosen in routings]).mean(0)  # (B, E)
    probs = torch.stack([probs.mean(1) for probs, _ in routings]).mean(0)
    return experts ** 2 * (tokens * probs).mean()
