"""``--set`` and the REST ``overrides``: ``a.b.c=value`` sets a key, ``~a.b.c`` removes one.

Overrides apply to the params form of the file (a ``trainer:`` file is translated first), so
``model.hidden_size=256`` works in every layout; a trainer path (``trainer.init.model.x=1``)
is translated the same way. Values are YAML (``2``, ``1.0e-3``, ``[a, b]``, ``null``) unless
the schema types the key as a string.
"""

from __future__ import annotations

from typing import Any

import yaml

from csx_config import trainer
from csx_config.inputs import InputSpec, TrainInputSpec
from csx_config.layouts import moe_release_default
from csx_config.model import ModelSpec
from csx_config.sections import OptimizerSpec, RunConfigSpec

REMOVE = "~"
_SECTIONS = {"train_input": TrainInputSpec, "eval_input": InputSpec, "model": ModelSpec,
             "optimizer": OptimizerSpec, "runconfig": RunConfigSpec}


def _keeps_text(section: str, key: str) -> bool:
    """Whether the schema types ``section.key`` as a plain string (so '2024' stays a string)."""
    cls = _SECTIONS.get(section)
    field = cls.model_fields.get(key) if cls else None
    return field is not None and field.annotation in (str, str | None)


def params_path(path: str) -> list[str]:
    """The params-layout keys of an override path given in either layout."""
    if not path.startswith("trainer."):
        return path.split(".")
    rest = path.removeprefix("trainer.")
    for prefix, section in trainer.SECTIONS.items():
        if rest.startswith(prefix + "."):
            return [section, *rest.removeprefix(prefix + ".").split(".")]
    if rest.startswith("init.sparsity."):
        return ["sparsity", *rest.removeprefix("init.sparsity.").split(".")]
    if rest in trainer.KEYS:
        return trainer.KEYS[rest].split(".")
    raise ValueError(f"override path {path!r}: set trainer keys by their params path "
                     "(model.x, optimizer.x, runconfig.x, train_input.x, sparsity.x)")


def with_overrides(params: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``params`` in the params layout with each override applied (a deep copy).

    Args:
        params: A parsed file, any layout (a ``trainer:`` file is translated first).
        overrides: ``section.key=value`` (the value read as YAML) or ``~section.key`` (remove
            the key), applied in order.

    Raises:
        ValueError: An override that has neither form, whose path crosses a value that is not
            a section, or a ``trainer:`` key with no params path.
    """
    if not overrides:
        return params
    result = yaml.safe_load(yaml.safe_dump(params))  # a deep copy of plain data
    if trainer.is_trainer(result):
        result, problems = trainer.to_params(result)
        if problems:  # the untranslatable keys are reported by validation, not lost here
            raise ValueError("; ".join(message for _, message in problems))
        moe_release_default(result, "trainer")  # before it reads as a params-layout file
    for override in overrides:
        _apply(result, override)
    return result


def _apply(result: dict[str, Any], override: str) -> None:
    remove = override.startswith(REMOVE)
    path, sep, raw = override.removeprefix(REMOVE).partition("=")
    keys = params_path(path.strip()) if path.strip() else []
    if not keys or not all(keys) or remove == bool(sep):
        raise ValueError(f"override {override!r} must look like section.key=value, or "
                         f"{REMOVE}section.key to remove a key")
    node = result
    for key in keys[:-1]:
        child = node.get(key)
        if child is None and not remove:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ValueError(f"override {override!r}: {key} is not a section of this file")
        node = child
    if remove:
        if keys[-1] not in node:
            raise ValueError(f"override {override!r}: {'.'.join(keys)} is not in this file")
        del node[keys[-1]]
        return
    node[keys[-1]] = raw if len(keys) == 2 and _keeps_text(*keys) else yaml.safe_load(raw)
