"""The params layout of ModelZoo 1.x (releases 1.6 to 1.9): the keys 2.0 renamed or dropped,
and their upgrade to the current meaning.

Each upgrade keeps what the key did: ``use_rms_norm: true`` becomes ``norm_type: rmsnorm`` (not
silently LayerNorm), ``beta1``/``beta2`` become ``betas``, a scheduler's ``steps`` wins over its
``decay_steps`` as in 1.x. The 1.x keys that change nothing here (``save_losses``,
``show_debug_metrics``, ...) stay in the spec as not applied (csx_config.keys says why).
"""

from __future__ import annotations

from typing import Any

from csx_config.keys import Problem

# Keys only a 1.x file has: their presence tells the layout.
RENAMED = {"model.use_position_embedding", "model.use_rms_norm", "optimizer.beta1",
           "optimizer.beta2", "optimizer.epsilon", "optimizer.use_bias_correction"}
V1_ONLY = RENAMED | {"runconfig.save_losses", "runconfig.show_debug_metrics",
                     "runconfig.log_step_count_steps", "runconfig.execution_strategy",
                     "optimizer.disable_lr_steps_reset", "optimizer.ws_summary",
                     "train_input.use_multiple_workers"}
TORCH_BETAS = (0.9, 0.999)  # what a missing beta1 or beta2 meant: torch's default
_POSITIONS_WITHOUT_TABLE = ("rotary", "alibi")


def is_v1(params: dict[str, Any]) -> bool:
    """Whether ``params`` uses a key only 1.x files have (a 1.x file without one is, key for
    key, a 2.x file)."""
    for path in V1_ONLY:
        section, key = path.split(".", 1)
        if isinstance(params.get(section), dict) and key in params[section]:
            return True
    return any("steps" in item and "decay_steps" in item for item in _schedulers(params))


def upgrade(params: dict[str, Any], notes: list[str]) -> list[Problem]:
    """Rewrite the 1.x keys of ``params`` (in place) to their current meaning."""
    problems: list[Problem] = []
    model = params.get("model") if isinstance(params.get("model"), dict) else {}
    optimizer = params.get("optimizer") if isinstance(params.get("optimizer"), dict) else {}
    problems += _position_embedding(model, notes)
    problems += _rms_norm(model, notes)
    problems += _betas(optimizer, notes)
    problems += _rename(optimizer, "epsilon", "eps", notes)
    problems += _rename(optimizer, "use_bias_correction", "correct_bias", notes)
    for index, item in enumerate(_schedulers(params)):
        _scheduler_steps(item, index, notes)
    return problems


def _position_embedding(model: dict[str, Any], notes: list[str]) -> list[Problem]:
    if "use_position_embedding" not in model:
        return []
    used = model.pop("use_position_embedding")
    kind = model.get("position_embedding_type")
    if used is False and kind not in _POSITIONS_WITHOUT_TABLE:
        return [(("model", "use_position_embedding"),
                 "model.use_position_embedding: false (a model without position embeddings) is "
                 "not supported here; set model.position_embedding_type: learned or rotary")]
    notes.append(f"model.use_position_embedding: {used} -> the positions model.position_embedding_type "
                 f"gives ({kind or 'learned'})")
    return []


def _rms_norm(model: dict[str, Any], notes: list[str]) -> list[Problem]:
    if "use_rms_norm" not in model:
        return []
    norm = "rmsnorm" if model.pop("use_rms_norm") else "layernorm"
    if model.get("norm_type") not in (None, norm):
        return [(("model", "use_rms_norm"), f"model.use_rms_norm says {norm} but model.norm_type is "
                                            f"{model['norm_type']!r}: remove one")]
    model["norm_type"] = norm
    notes.append(f"model.use_rms_norm -> model.norm_type: {norm}")
    return []


def _betas(optimizer: dict[str, Any], notes: list[str]) -> list[Problem]:
    if "beta1" not in optimizer and "beta2" not in optimizer:
        return []
    betas = [optimizer.pop("beta1", TORCH_BETAS[0]), optimizer.pop("beta2", TORCH_BETAS[1])]
    if optimizer.get("betas") not in (None, betas):
        return [(("optimizer", "betas"), f"optimizer.beta1/beta2 {betas} and optimizer.betas "
                                         f"{optimizer['betas']} disagree: remove one")]
    optimizer["betas"] = betas
    notes.append(f"optimizer.beta1/beta2 -> optimizer.betas: {betas}")
    return []


def _rename(section: dict[str, Any], old: str, new: str, notes: list[str]) -> list[Problem]:
    if old not in section:
        return []
    value = section.pop(old)
    if section.get(new, value) != value:
        return [(("optimizer", old), f"optimizer.{old} ({value}) and optimizer.{new} "
                                     f"({section[new]}) disagree: remove one")]
    section[new] = value
    notes.append(f"optimizer.{old} -> optimizer.{new}: {value}")
    return []


def _schedulers(params: dict[str, Any]) -> list[dict[str, Any]]:
    optimizer = params.get("optimizer")
    rate = optimizer.get("learning_rate") if isinstance(optimizer, dict) else None
    items = rate if isinstance(rate, list) else [rate]
    return [item for item in items if isinstance(item, dict)]


def _scheduler_steps(item: dict[str, Any], index: int, notes: list[str]) -> None:
    """1.x read ``steps`` as the scheduler's length and copied it over ``decay_steps``; its
    Linear scheduler read no ``alpha``."""
    if "steps" in item and "decay_steps" in item:
        item.pop("decay_steps")
        notes.append(f"optimizer.learning_rate[{index}]: steps and decay_steps -> total_iters: "
                     f"{item['steps']} (1.x: steps wins)")
    if "alpha" in item and str(item.get("scheduler", "")).lower() in ("linear", "linearlr"):
        item.pop("alpha")
        notes.append(f"optimizer.learning_rate[{index}].alpha: not read by a Linear scheduler (1.x)")


