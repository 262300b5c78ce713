"""Positions: rotary embeddings (RoPE) with linear, Llama-3.1 and YaRN scaling, ALiBi's
per-head distance bias, and which keys each query sees (causal, sliding window, sink tokens)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from models.config import POS_SCALING_ARGS


def rope_frequencies(rotary_dim: int, theta: float, scaling_type: str = "linear", factor: float = 1.0,
                     scaling_args: dict[str, Any] | None = None, device: Any = None) -> tuple[torch.Tensor, float]:
    """The inverse frequency of each rotated channel pair, and the factor on cos and sin (YaRN's
    attention temperature). Linear scaling divides the positions instead (``rope_tables``)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
    scaling_type = scaling_type.lower()
    args = {**POS_SCALING_ARGS[scaling_type], **(scaling_args or {})}
    if scaling_type == "llama3":
        return _llama3_frequencies(inv_freq, factor, **args), 1.0
    if scaling_type == "yarn":
        return _yarn_frequencies(inv_freq, rotary_dim, theta, factor, **args)
    return inv_freq, 1.0


def _llama3_frequencies(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> torch.Tensor:
    """Llama-3.1: wavelengths shorter than original / high_freq_factor are kept, longer than
    original / low_freq_factor are divided by the factor, and those between are blended."""
    wavelength = 2 * math.pi / inv_freq
    smooth = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelength < original_max_position_embeddings / high_freq_factor, inv_freq,
                       torch.where(wavelength > original_max_position_embeddings / low_freq_factor,
                                   inv_freq / factor, blended))


def _yarn_frequencies(inv_freq: torch.Tensor, rotary_dim: int, theta: float, factor: float, *,
                      original_max_position_embeddings: int, beta_fast: float, beta_slow: float,
                      extrapolation_factor: float, mscale_a: float, mscale_b: float,
                      truncate: bool) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, arXiv:2309.00071): pairs that turn more than beta_fast times over
    the original context keep their frequency, fewer than beta_slow are interpolated (divided by
    the factor), a linear ramp between; the logits get the temperature a·ln(factor) + b."""
    def pair_index(rotations: float) -> float:
        turns = original_max_position_embeddings / (rotations * 2 * math.pi)
        return rotary_dim * math.log(turns) / (2 * math.log(theta))

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    pairs = torch.arange(rotary_dim // 2, dtype=torch.float32, device=inv_freq.device)
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)
    kept = (1 - ramp) * extrapolation_factor
    mscale = mscale_a * math.log(factor) + mscale_b if factor > 1 else 1.0
    return inv_freq / factor * (1 - kept) + inv_freq * kept, mscale


def rope_tables(rotary_dim: int, length: int, theta: float, device: Any = None, *, scaling_type: str = "linear",
                factor: float = 1.0, scaling_args: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (length, rotary_dim // 2) for rotating channel pairs; linear
    scaling (position interpolation, Chen et al. 2023) divides the positions by ``factor``."""
    inv_freq, mscale = rope_frequencies(rotary_dim, theta, scaling_type, factor, scaling_args, device)
    positions = torch.arange(length, dtype=torch.float32, device=device)
    if scaling_type.lower() == "linear":
        positions = positions / factor
    angles = torch.outer(positions, inv_freq)
    return angles.cos() * mscale, angles.sin() * mscale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (even, odd) channel pairs of the first ``2 * cos.shape[-1]`` channels of x
    (B, H, T, D) by position-dependent angles; the other channels pass through."""
    seq, rotated_dims = x.shape[-2], 2 * cos.shape[-1]
    cos, sin = cos[:seq], sin[:seq]
    part, rest = x[..., :rotated_dims], x[..., rotated_dims:]
    even, odd = part[..., 0::2], part[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def alibi_slopes(num_heads: int) -> list[float]:
    """Press et al. 2022: for 2^k heads the geometric sequence 2^(-8/n), 2^(-16/n), ...; for
    other counts that sequence for the largest power of two below, then every other slope of
    the sequence for twice that power."""
    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    power = 2 ** math.floor(math.log2(num_heads))
    return geometric(power) + geometric(2 * power)[0::2][:num_heads - power]


class AlibiPositions(nn.Module):
    """ModelZoo's ALiBi ``position_embed_helper``: adds ``-slope_h · |i - j| / pos_scaling_factor``
    to the attention logits of query i and key j in head h. Fixed slopes are a buffer (not a
    parameter); trainable ones start from ModelZoo's xavier_uniform draw."""

    def __init__(self, num_heads: int, trainable: bool, scaling_factor: float) -> None:
        super().__init__()
        if trainable:
            self.slopes = nn.Parameter(torch.empty(num_heads, 1))
        else:
            self.register_buffer("slopes", torch.tensor(alibi_slopes(num_heads)).unsqueeze(-1), persistent=False)
        self.scaling_factor = scaling_factor

    def forward(self, length: int, device: Any) -> torch.Tensor:
        positions = torch.arange(length, dtype=torch.float32, device=device)
        distance = (positions[:, None] - positions[None, :]).abs()
        return -(self.slopes[:, :, None] / self.scaling_factor) * distance  # (heads, T, T)


def visible_keys(length: int, window: int | None, sink_tokens: int | None, device: Any = None) -> torch.Tensor:
    """(T, T) bool, True where query i sees key j: j <= i and, with a sliding window, i - j <
    window (itself and window - 1 before it) or j among the first sink_tokens."""
    positions = torch.arange(length, device=device)
    query, key = positions[:, None], positions[None, :]
    visible = key <= query
    if window is not None:
        visible &= (query - key < window) | (key < (sink_tokens or 0))
    return visible
