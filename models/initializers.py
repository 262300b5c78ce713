"""ModelZoo's initializers: the named torch.nn.init functions, TensorFlow's variance scaling, and
which initializer each role of the decoder gets (with muP's width and depth scaling)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from models.config import ModelConfig


# std of a unit normal cut at two standard deviations, to undo for variance_scaling's truncated draw
TRUNCATED_NORMAL_STD = 0.87962566103423978


def variance_scaling_(tensor: torch.Tensor, scale: float = 1.0, mode: str = "fan_in",
                      distribution: str = "truncated_normal") -> torch.Tensor:
    """ModelZoo's variance_scaling (the TensorFlow initializer): variance scale / n, n the fan
    in, fan out or their mean; drawn from a truncated normal (cut at 2 std, the std corrected so
    the variance is kept), a normal, or a uniform distribution."""
    fan_in, fan_out = nn.init._calculate_fan_in_and_fan_out(tensor)
    fans = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}
    if mode not in fans:
        raise ValueError(f"variance_scaling mode {mode!r} is not one of {list(fans)}")
    variance = scale / max(1.0, fans[mode])
    if distribution == "truncated_normal":
        std = math.sqrt(variance) / TRUNCATED_NORMAL_STD
        return nn.init.trunc_normal_(tensor, std=std, a=-2 * std, b=2 * std)
    if distribution in ("normal", "untruncated_normal"):
        return nn.init.normal_(tensor, std=math.sqrt(variance))
    if distribution == "uniform":
        limit = math.sqrt(3 * variance)
        return nn.init.uniform_(tensor, -limit, limit)
    raise ValueError(f"variance_scaling distribution {distribution!r} is not one of "
                     "['truncated_normal', 'normal', 'untruncated_normal', 'uniform']")


INIT_FUNCTIONS = {"normal": nn.init.normal_, "truncated_normal": nn.init.trunc_normal_,
                  "uniform": nn.init.uniform_, "xavier_uniform": nn.init.xavier_uniform_,
                  "xavier_normal": nn.init.xavier_normal_, "zeros": nn.init.zeros_, "ones": nn.init.ones_,
                  "variance_scaling": variance_scaling_}
Initializer = dict[str, Any]


def default_initializer(std: float) -> Initializer:
    """ModelZoo's default: a truncated normal of ``std`` cut at two standard deviations."""
    return {"name": "truncated_normal", "mean": 0.0, "std": std, "a": -2 * std, "b": 2 * std}


def scaled_initializer(spec: Initializer, factor: float) -> Initializer:
    """``spec`` with its spread times ``factor`` (muP and depth scaling); like ModelZoo, only
    normal and truncated normal initializers are scaled."""
    if spec["name"] == "normal":
        return {**spec, "std": spec.get("std", 1.0) * factor}
    if spec["name"] == "truncated_normal":
        return {**spec, **{k: spec[k] * factor for k in ("std", "a", "b") if k in spec}}
    return spec


def initializers(c: ModelConfig) -> dict[str, Initializer]:
    """The initializer of each role (embedding, block input projections, FFN input, attention
    output, FFN output, MoE router), as ModelZoo chooses them: residual-stream outputs default to
    std / sqrt(2L), and muP scales the block initializers by the width multipliers
    (hidden / base)^-1/2, the outputs also by (2L)^-1/2. GPTJModel has no depth scaling and
    draws the FFN input from the output layer's initializer."""
    default = default_initializer(c.initializer_range)
    gate = (c.moe or {}).get("gate_initializer") or default
    if c.is_parallel:
        output = c.output_layer_initializer or default
        block, ffn_input, ffn_output = c.initializer or default, output, output
        if c.mup_base_hidden_size:
            width = (c.hidden_size / c.mup_base_hidden_size) ** -0.5
            depth = (2 * c.num_hidden_layers) ** -0.5
            block, ffn_input = scaled_initializer(block, width), scaled_initializer(ffn_input, width)
            output = ffn_output = scaled_initializer(output, width * depth)
        if c.mup_base_filter_size:
            ffn_output = scaled_initializer(c.output_layer_initializer or default,
                                            (c.filter_size / c.mup_base_filter_size) ** -0.5
                                            * (2 * c.num_hidden_layers) ** -0.5)
        return {"embedding": c.embedding_initializer or default, "block": block, "ffn_input": ffn_input,
                "output": output, "ffn_output": ffn_output, "gate": gate}
    depth = (2 * c.num_hidden_layers) ** -0.5
    block = c.initializer or default
    output = c.output_layer_initializer or (block if c.initializer else scaled_initializer(default, depth))
    ffn_output = output
    if c.mup_base_hidden_size:
        width = (c.hidden_size / c.mup_base_hidden_size) ** -0.5
        block = scaled_initializer(block, width)
        output = scaled_initializer(c.output_layer_initializer or default, width * depth)
        ffn_output = output
    if c.mup_base_filter_size:
        ffn_output = scaled_initializer(default, (c.filter_size / c.mup_base_filter_size) ** -0.5 * depth)
    return {"embedding": c.embedding_initializer or default, "block": block, "ffn_input": block,
            "output": output, "ffn_output": ffn_output, "gate": gate}


def _initialize(param: torch.Tensor, spec: Initializer) -> None:
    INIT_FUNCTIONS[spec["name"]](param, **{k: v for k, v in spec.items() if k != "name"})
