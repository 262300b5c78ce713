"""ModelZoo's feed-forward network: two linear layers, the first with a plain or a gated (GLU)
nonlinearity."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig

GLU_ACTIVATIONS = {"swiglu": F.silu, "geglu": F.gelu, "reglu": F.relu}
ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
               "silu": F.silu, "swish": F.silu}


class FeedForwardLayer(nn.Module):
    """ModelZoo's SingleFeedForwardLayer: act(linear_layer(x)), times linear_layer_for_glu(x)
    for a GLU nonlinearity."""

    def __init__(self, in_features: int, out_features: int, bias: bool, activation: str | None) -> None:
        super().__init__()
        self.linear_layer = nn.Linear(in_features, out_features, bias=bias)
        self.activation = activation
        if activation in GLU_ACTIVATIONS:
            self.linear_layer_for_glu = nn.Linear(in_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_layer(x)
        if self.activation in GLU_ACTIVATIONS:
            return GLU_ACTIVATIONS[self.activation](y) * self.linear_layer_for_glu(x)
        return ACTIVATIONS[self.activation](y) if self.activation else y


def feed_forward_layers(config: ModelConfig) -> nn.ModuleList:
    """ModelZoo's two FFN layers: hidden -> filter with the nonlinearity, filter -> hidden."""
    return nn.ModuleList([
        FeedForwardLayer(config.hidden_size, config.filter_size, config.use_ffn_bias, config.nonlinearity),
        FeedForwardLayer(config.filter_size, config.hidden_size, config.use_ffn_bias, None)])


class FeedForwardNetwork(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ffn = feed_forward_layers(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn[1](self.ffn[0](x))
