"""The params layout of ModelZoo 2.x (``train_input``, ``eval_input``, ``model``,
``optimizer``, ``sparsity``, ``runconfig``): the layout JobSpec stores, and the one upgrade it
needs, keys of a ModelZoo feature given at the value that means the model built here anyway.
"""

from __future__ import annotations

from typing import Any

from csx_config.model import ModelSpec

SECTIONS = ("train_input", "eval_input", "model", "optimizer", "sparsity", "runconfig")
# model key -> the values that build the standard decoder (so the key changes nothing). Only
# used while the key is not a ModelSpec field: once the feature is built, the field takes it.
STANDARD_VALUES: dict[str, tuple[Any, ...]] = {
    "fixed_sparse_attention": (None,),
}


def upgrade(params: dict[str, Any], notes: list[str]) -> None:
    """Drop (in place) the feature keys whose value is the standard decoder's, noting each."""
    model = params.get("model")
    if not isinstance(model, dict):
        return
    for key, standard in STANDARD_VALUES.items():
        if key in model and key not in ModelSpec.model_fields and model[key] in standard:
            notes.append(f"model.{key}: {model.pop(key)} is the decoder built here")
