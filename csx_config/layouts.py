"""Which layout a file is in (1.x params, 2.x params, ``trainer:``), its normalised params
form, and the conversion between the layouts that ``csx convert`` writes."""

from __future__ import annotations

import copy
from typing import Any, Literal

from csx_config import params_v1, params_v2, trainer
from csx_config.families import family_refusal
from csx_config.keys import Problem

Layout = Literal["params_v1", "params_v2", "trainer"]


def detect_layout(data: dict[str, Any]) -> Layout:
    """Which ModelZoo layout a parsed file uses: ``"trainer"`` (a ``trainer:`` section),
    ``"params_v1"`` (1.x keys) or ``"params_v2"``."""
    if trainer.is_trainer(data):
        return "trainer"
    return "params_v1" if params_v1.is_v1(data) else "params_v2"


def normalise(data: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[Problem]]:
    """The params form of a file in any layout, with deprecated keys upgraded: (params, notes
    on each upgrade, problems that stop it). A file of a model family not built here has that
    one problem and nothing else (csx_config.families)."""
    if trainer.is_trainer(data):
        params, problems = trainer.to_params(data)
    else:
        params, problems = copy.deepcopy(data), []
    refused = family_refusal(params)
    if refused is not None:
        return {}, [], [refused]
    notes: list[str] = []
    problems += params_v1.upgrade(params, notes)
    params_v2.upgrade(params, notes)
    moe_release_default(params, "trainer" if trainer.is_trainer(data) else "params")
    return params, notes, problems


def to_layout(params: dict[str, Any], layout: Literal["params", "trainer"]) -> tuple[dict[str, Any], list[str]]:
    """A validated spec's params dict (``JobSpec.model_dump``) in ``layout``, and the keys that
    layout has no home for (left out)."""
    if layout == "trainer":
        return trainer.from_params(params)
    return copy.deepcopy(params), []


# ModelZoo's default moe_implementation, which decides the experts' parameter names: "optimized"
# (fused) up to release 2.5, "experimental" (an expert each, shared ones apart) from 2.6. MoE
# params-layout files are 2.3's (2.4 moved every config to the trainer layout); a trainer-layout
# file runs on the current release (2.10), its content being the same in 2.5 and 2.10.
MOE_RELEASE_DEFAULTS = {"params": "optimized", "trainer": "experimental"}


def moe_release_default(params: dict[str, Any], layout: str) -> None:
    """Write the release's moe_implementation into a MoE section that names none (in place), so
    the spec keeps its parameter names in either layout it is written in (the plan names them)."""
    model = params.get("model")
    key = next((k for k in ("moe", "moe_params") if isinstance(model, dict) and isinstance(model.get(k), dict)), None)
    if key is not None and model[key].get("moe_implementation") is None:
        model[key]["moe_implementation"] = MOE_RELEASE_DEFAULTS[layout]
