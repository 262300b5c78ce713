"""The input sections of the params layout (``train_input``, ``eval_input``): which data, how
it is batched, ModelZoo's weighted ``mixture`` of data sets and its ``data_transforms``
(``add_sink_tokens``). What they mean when read is training/data.py's and training/hdf5.py's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from csx_config.families import PROCESSOR_FAMILIES
from csx_config.keys import Section

HDF5_PROCESSORS = ("GptHDF5DataProcessor", "GptHDF5MapDataProcessor")
# ModelZoo's data transforms not built here, with what each does.
TRANSFORMS_NOT_BUILT = {"add_memory_tokens": "activation-beacon memory tokens (add_memory_tokens)",
                        "add_pose_shift": "PoSE position shifting (add_pose_shift)"}


class MixtureEntrySpec(Section):
    """One data set of a ``mixture``: its HDF5 folder(s) and its weight (the weights are
    normalised over those above 0)."""
    SECTION = "mixture"
    data_dir: str | list[str]
    weight: float = Field(ge=0.0)

    def data_dirs(self) -> list[str]:
        return [self.data_dir] if isinstance(self.data_dir, str) else list(self.data_dir)


class SinkTokensSpec(Section):
    """ModelZoo's ``add_sink_tokens`` transform (StreamingLLM's attention sinks, Xiao et al.
    2023, arXiv:2309.17453): ``num_sink_tokens`` tokens ``sink_token_id`` inserted at
    ``sink_token_start_pos`` of every sample, outside the loss; the samples grow by that many
    tokens unless ``truncate_to_original_length``."""
    SECTION = "data_transforms"
    name: Literal["add_sink_tokens"]
    sink_token_id: NonNegativeInt = 0
    num_sink_tokens: PositiveInt = 1
    sink_token_start_pos: NonNegativeInt = 0
    truncate_to_original_length: bool = False

    def added_tokens(self) -> int:
        return 0 if self.truncate_to_original_length else self.num_sink_tokens


class InputSpec(Section):
    """The ``eval_input`` section: which data, and how it is batched (``batch_size`` is the
    global batch in samples, split evenly over ``num_csx``). The data is ``data_dir`` or a
    weighted ``mixture`` of HDF5 data sets, not both. Hardware-only keys are accepted and
    listed as not applied."""

    SECTION = "eval_input"
    NOT_APPLIED = frozenset({
        "num_workers", "prefetch_factor", "persistent_workers", "micro_batch_size", "use_worker_cache",
        "shuffle_buffer", "repeat", "drop_last", "mixed_precision", "use_vsl", "pad_last",
        "vocab_size", "num_samples"})
    data_processor: str | None = None  # None: HDF5 when data_dir holds .h5 files, else text
    data_dir: str | list[str] | None = None  # eval_input: None means "the train_input data_dir"
    mixture: list[MixtureEntrySpec] | None = None
    data_transforms: list[SinkTokensSpec] | None = None
    batch_size: PositiveInt = 16  # GLOBAL batch, split evenly over num_csx
    max_sequence_length: PositiveInt | None = None  # None: the HDF5 data's, else the model's
    shuffle: bool = False
    shuffle_seed: int | None = None  # None: runconfig.seed

    @model_validator(mode="before")
    @classmethod
    def _mixture_or_data_dir(cls, data: Any) -> Any:
        """ModelZoo takes exactly one of data_dir and mixture; with a mixture, data_dir is
        None (so a dumped spec validates again)."""
        if isinstance(data, dict) and data.get("mixture") is not None:
            if data.get("data_dir") is not None:
                raise ValueError(f"{cls.SECTION}: give data_dir or mixture, not both (ModelZoo reads one)")
            data = {**data, "data_dir": None}
        return data

    @field_validator("data_processor")
    @classmethod
    def _known_processor(cls, value: str | None) -> str | None:
        choices = (*HDF5_PROCESSORS, "TextDataProcessor")
        if value is not None and value not in choices:
            family = PROCESSOR_FAMILIES.get(value)
            what = f" (the data of ModelZoo's {family} model)" if family else ""
            raise ValueError(f"data_processor {value!r}{what} is not supported here; choose one of {list(choices)}")
        return value

    @field_validator("data_dir")
    @classmethod
    def _non_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and not value:
            raise ValueError("data_dir is an empty list")
        return value

    @field_validator("mixture")
    @classmethod
    def _weighted(cls, value: list[MixtureEntrySpec] | None) -> list[MixtureEntrySpec] | None:
        if value is not None and not any(entry.weight > 0 for entry in value):
            raise ValueError("at least one data set of the mixture needs a weight above 0")
        return value

    @field_validator("data_transforms", mode="before")
    @classmethod
    def _transforms_built(cls, value: Any) -> Any:
        for index, transform in enumerate(value if isinstance(value, list) else []):
            name = transform.get("name") if isinstance(transform, dict) else None
            if isinstance(name, str) and name in TRANSFORMS_NOT_BUILT:  # any other: the Literal refuses it
                raise ValueError(f"data_transforms[{index}]: {TRANSFORMS_NOT_BUILT[name]} is not supported here")
        return value

    def data_dirs(self) -> list[str]:
        """Every folder this section reads (a mixture's too)."""
        if self.mixture is not None:
            return [folder for entry in self.mixture for folder in entry.data_dirs()]
        return [] if self.data_dir is None else [self.data_dir] if isinstance(self.data_dir, str) else list(self.data_dir)

    def added_tokens(self) -> int:
        """Tokens the data transforms add to each sample."""
        return sum(transform.added_tokens() for transform in self.data_transforms or [])


class TrainInputSpec(InputSpec):
    """The ``train_input`` section: as [`InputSpec`][csx_config.InputSpec], with the training
    data (default ``builtin:shakespeare``), shuffled by default."""

    SECTION = "train_input"
    data_dir: str | list[str] | None = "builtin:shakespeare"  # None only with a mixture
    shuffle: bool = True
