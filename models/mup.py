"""muP's per-layer learning rates: ModelZoo's ``lr_adjustment_groups`` and the factor each
parameter's learning rate gets."""

from __future__ import annotations

import fnmatch

from csx_config import LR_ADJUSTMENT_GROUPS
from models.config import ModelConfig


def lr_adjustment_scales(config: ModelConfig, adjust: dict[str, float] | None = None) -> dict[str, float]:
    """The learning-rate factor of each group: with muP's base sizes 1 / the width multiplier
    for the attention and FFN input kernels (hidden / mup_base_hidden_size) and the FFN output
    kernels (filter / mup_base_filter_size); ``adjust`` (``optimizer.adjust_learning_rate``,
    the 1.x muP files' ``{decoder_kernel: 1/3}``) sets groups by name."""
    scales = dict.fromkeys(LR_ADJUSTMENT_GROUPS, 1.0)
    if config.mup_base_hidden_size and config.mup_base_filter_size:
        scales["decoder_attention"] = scales["decoder_input_ffn"] = config.mup_base_hidden_size / config.hidden_size
        scales["decoder_output_ffn"] = config.mup_base_filter_size / config.filter_size
    for group, scale in (adjust or {}).items():
        if group not in scales:
            raise ValueError(f"optimizer.adjust_learning_rate.{group} is not one of {list(LR_ADJUSTMENT_GROUPS)}")
        scales[group] = scale
    return scales


def learning_rate_scale(scales: dict[str, float], name: str) -> float:
    """The factor of parameter ``name``: its first group (in ModelZoo's order) with a factor."""
    for group, globs in LR_ADJUSTMENT_GROUPS.items():
        if scales[group] != 1.0 and any(fnmatch.fnmatchcase(name, glob) for glob in globs):
            return scales[group]
    return 1.0
