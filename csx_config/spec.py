"""``JobSpec``: one typed job for the CLI and the REST API, from a ModelZoo file in any layout.

A file is normalised first (csx_config.layouts: the ``trainer:`` layout translated, 1.x keys
upgraded), then validated section by section; every unknown key and every bad value of the
file is reported in one ValidationError, each with its path.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, field_validator, model_validator

from csx_config.inputs import InputSpec, TrainInputSpec
from csx_config.keys import relocated, validate_all_keys
from csx_config.layouts import normalise, to_layout
from csx_config.model import ModelSpec
from csx_config.overrides import with_overrides
from csx_config.sections import (
    OptimizerSpec,
    RunConfigSpec,
    batch_split_problem,
    check_level,
    check_sparsity_levels,
)
from csx_config.trainer import is_trainer, trainer_loc

# libyaml's parser and emitter (C) where PyYAML has them: the pure-Python ones took a fifth of
# a plan's time.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class JobSpec(BaseModel):
    """A ModelZoo params file, validated and normalised: the sections the CLI and the service
    run (``train_input``, ``eval_input``, ``model``, ``optimizer``, ``sparsity``,
    ``runconfig``).

    Any layout validates (1.x params, 2.x params, the ``trainer:`` layout): deprecated keys are
    read as their current meaning (see [`upgrades`][csx_config.JobSpec.upgrades]) and
    hardware-only keys are accepted but not applied (see
    [`not_applied`][csx_config.JobSpec.not_applied]).

    Raises:
        pydantic.ValidationError: On validation, every unknown or invalid key at once, each
            with its path in the file and the key it probably meant; a feature not built here
            is refused by name.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)

    train_input: TrainInputSpec = TrainInputSpec()
    eval_input: InputSpec = InputSpec()
    model: ModelSpec = ModelSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    sparsity: float | dict[str, Any] | list[Any] | None = None
    runconfig: RunConfigSpec = RunConfigSpec()
    _upgrades: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _normalised(cls, data: Any, handler: Any) -> Any:
        if not isinstance(data, dict):
            return handler(data)
        params, notes, problems = normalise(data)
        problems += batch_split_problems(params)
        try:
            spec = validate_all_keys(cls, params, handler, set(cls.model_fields), "params", problems)
        except ValidationError as err:  # named where the file has them
            raise relocated(err, cls.__name__, trainer_loc) if is_trainer(data) else err from None
        spec._upgrades = notes
        return spec

    @field_validator("sparsity")
    @classmethod
    def _sparsity_levels(cls, value: Any) -> Any:
        if isinstance(value, float):
            check_level(value, "sparsity")
        else:
            check_sparsity_levels(value, "sparsity")
        return value

    @classmethod
    def from_yaml(cls, text: str, overrides: list[str] | None = None) -> JobSpec:
        """Parse a ModelZoo file (any layout), then apply ``section.key=value`` / ``~section.key``
        overrides; a YAML or field error raises ValueError naming the problem (a
        ValidationError lists them all)."""
        return cls.model_validate(with_overrides(parse_yaml(text), overrides or []))

    def to_yaml(self) -> str:
        return yaml.dump(self.model_dump(mode="json", exclude_none=True), Dumper=YAML_DUMPER,
                         sort_keys=False)

    def to_layout(self, layout: str) -> tuple[dict[str, Any], list[str]]:
        """This spec as a file in ``layout`` (params or trainer), keeping the keys the file
        set; and the keys that layout has no home for."""
        return to_layout(self.model_dump(mode="json", exclude_unset=True), layout)

    def eval_data_dirs(self) -> list[str]:
        return self.eval_input.data_dirs() or self.train_input.data_dirs()

    def not_applied(self) -> list[str]:
        """The hardware-only keys of this file: accepted, but they change nothing here."""
        return list(self.not_applied_reasons())

    def not_applied_reasons(self) -> dict[str, str]:
        sections = (self.train_input, self.eval_input, self.model, self.optimizer, self.runconfig)
        return {key: why for section in sections for key, why in section.not_applied().items()}

    def upgrades(self) -> list[str]:
        """How the file's deprecated keys were read (``model.use_rms_norm -> ...``)."""
        return list(self._upgrades)


def batch_split_problems(params: dict[str, Any]) -> list[tuple[tuple[str, ...], str]]:
    """The global batch must split evenly over runconfig.num_csx: checked with the schema, so a
    file hears of it together with its other problems."""
    sections = [params.get(name) for name in ("train_input", "runconfig")]
    if not all(isinstance(section, dict) for section in sections):
        return []
    batch = sections[0].get("batch_size", TrainInputSpec.model_fields["batch_size"].default)
    num_csx = sections[1].get("num_csx", RunConfigSpec.model_fields["num_csx"].default)
    numbers = all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (batch, num_csx))
    problem = batch_split_problem(batch, num_csx) if numbers else None
    return [(("train_input", "batch_size"), problem)] if problem else []


def parse_yaml(text: str) -> dict[str, Any]:
    """A params file's YAML as a dict of sections (an empty file is ``{}``).

    Raises:
        ValueError: The YAML does not parse, or is not a mapping.
    """
    try:
        data = yaml.load(text, Loader=YAML_LOADER)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as err:
        raise ValueError(f"params YAML does not parse: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"params YAML must be a mapping of sections, got {type(data).__name__}")
    return data


__all__ = ["JobSpec", "parse_yaml", "with_overrides"]
