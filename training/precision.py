"""ModelZoo's precision keys, applied where they mean something: on a CUDA device.

``model.mixed_precision`` with ``model.fp16_type`` (``bfloat16`` / ``cbfloat16``: bf16
autocast; ``float16``, ModelZoo's default: fp16 autocast with loss scaling), or
``model.use_bfloat16``; the trainer layout's ``precision:`` block arrives as these keys
(csx_config.trainer). fp16 scales the loss as ``optimizer.loss_scaling_factor`` says:
``dynamic`` (the default) is ``torch.amp.GradScaler`` starting at ``initial_loss_scale`` and
growing every ``steps_per_increase`` steps; a number is that fixed scale (the scaler never grows
it; an overflowing step is skipped and halves it, as any GradScaler does). ``min_loss_scale``
and ``max_loss_scale`` have no GradScaler counterpart and stay unapplied. On CPU training is
float32 and the keys are reported as not applied. A float32 run on CUDA is float32: nanoGPT
allows TF32 for its matmuls, but at its configuration they run in bf16 under autocast (as ours
do), where TF32 changes nothing, and in a float32 run TF32's 10-bit mantissa would move the
masks a gradient or magnitude ranking picks away from the CPU run's (bench/gpu_check.py
compares them).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from training.memory import autocasts

BF16_TYPES = ("bfloat16", "cbfloat16")
DEFAULT_INITIAL_SCALE = 2.0 ** 15  # GradScaler's own default
DEFAULT_STEPS_PER_INCREASE = 2000
NEVER = 2 ** 31 - 1


@dataclass(frozen=True)
class Precision:
    """How one rank computes: the autocast dtype (None: float32) and its loss scaling."""

    autocast_dtype: torch.dtype | None = None
    loss_scale: str | float | None = None  # "dynamic", a fixed scale, or None
    initial_scale: float = DEFAULT_INITIAL_SCALE
    growth_interval: int = DEFAULT_STEPS_PER_INCREASE
    applied: str = "float32"  # what the run reports

    def autocast(self, device: torch.device) -> Any:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        if self.loss_scale is None:
            return None
        return torch.amp.GradScaler(device.type, init_scale=self.initial_scale,
                                    growth_interval=self.growth_interval)


def resolve_precision(model_keys: dict[str, Any], optimizer_keys: dict[str, Any],
                      device: torch.device) -> Precision:
    """The precision of the spec's ``model`` and ``optimizer`` extras on `device`."""
    if not autocasts(model_keys):
        return Precision()
    fp16_type = "bfloat16" if model_keys.get("use_bfloat16") else \
        str(model_keys.get("fp16_type") or "float16")
    if fp16_type not in (*BF16_TYPES, "float16"):
        raise ValueError(f"model.fp16_type must be one of {[*BF16_TYPES, 'float16']}, "
                         f"got {fp16_type!r}")
    if device.type != "cuda":
        return Precision(applied=f"float32 (mixed_precision {fp16_type} applies on CUDA only)")
    if fp16_type in BF16_TYPES:
        return Precision(torch.bfloat16, applied=f"bf16 autocast ({fp16_type})")
    factor = optimizer_keys.get("loss_scaling_factor", "dynamic")
    if factor == "dynamic":
        initial = float(optimizer_keys.get("initial_loss_scale") or DEFAULT_INITIAL_SCALE)
        interval = int(optimizer_keys.get("steps_per_increase") or DEFAULT_STEPS_PER_INCREASE)
        return Precision(torch.float16, "dynamic", initial, interval,
                         applied=f"fp16 autocast, dynamic loss scaling from {initial:g} "
                                 f"(x2 every {interval} steps)")
    try:
        scale = float(factor)
    except (TypeError, ValueError):
        raise ValueError("optimizer.loss_scaling_factor must be 'dynamic' or a number, "
                         f"got {factor!r}") from None
    if not scale > 0:
        raise ValueError(f"optimizer.loss_scaling_factor must be > 0, got {factor!r}")
    return Precision(torch.float16, scale, scale, NEVER,
                     applied=f"fp16 autocast, fixed loss scale {scale:g}")
