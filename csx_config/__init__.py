"""The params schema of Cerebras ModelZoo files, for the CLI and the service: imports only
pydantic and yaml (the service validates jobs without loading torch).

    families      the ModelZoo model families built here, and the refusal of the others
    inputs        the input sections (train_input, eval_input): data, mixtures, data transforms
    sections      the optimizer and runconfig sections and their fields, the batch rule
    model         the model section: ModelZoo's decoder keys, defaults, presets
    keys          keys not applied here and why, features refused, hints, all errors at once
    params_v1     1.x keys and their upgrade to the current meaning
    params_v2     the 2.x params layout JobSpec stores
    trainer       the ``trainer:`` layout, to and from params
    layouts       layout detection, normalisation, conversion
    overrides     ``--set section.key=value`` and ``--set ~section.key``
    schedulers    learning-rate schedules
    spec          JobSpec
"""

from csx_config.model import (
    GLU_NONLINEARITIES,
    INITIALIZERS,
    MODEL_KEYS,
    MODELZOO_DEFAULTS,
    NONLINEARITIES,
    PRESETS,
    ModelSpec,
    PresetName,
    TokenizerSpec,
)
from csx_config.inputs import HDF5_PROCESSORS, InputSpec, TrainInputSpec
from csx_config.sections import (
    LR_ADJUSTMENT_GROUPS,
    MAX_CSX,
    OptimizerSpec,
    RunConfigSpec,
    batch_split_problem,
)
from csx_config.keys import format_problems, unknown_key_message
from csx_config.layouts import detect_layout
from csx_config.overrides import with_overrides
from csx_config.spec import JobSpec, parse_yaml

__all__ = ["GLU_NONLINEARITIES", "HDF5_PROCESSORS", "INITIALIZERS", "LR_ADJUSTMENT_GROUPS", "MAX_CSX",
           "MODEL_KEYS", "MODELZOO_DEFAULTS", "NONLINEARITIES", "PRESETS", "InputSpec", "JobSpec",
           "ModelSpec", "OptimizerSpec", "PresetName", "RunConfigSpec", "TokenizerSpec",
           "TrainInputSpec", "batch_split_problem", "detect_layout", "format_problems", "parse_yaml",
           "unknown_key_message", "with_overrides"]
