"""The job spec: one typed ``JobSpec`` for the CLI and the REST API (ModelZoo legacy layout).

Imports only pydantic and yaml, so the service can validate jobs without loading torch. Extra
keys are forbidden everywhere except inside ``sparsity``, which is free-form here (float, dict
or list) and validated in depth by ``sparsity.configure``; this module only checks that every
sparsity level in it lies in [0, 1). Checks that need the cluster size (global batch divisible by
``num_csx``) happen at run time, because ``csx run --num_csx`` may override the spec.

    train_input: {data_dir: builtin:shakespeare, batch_size: 16, seq_len: 64, shuffle: true}
    eval_input:  {batch_size: 16, seq_len: 64}           # data_dir defaults to train's
    model:       {preset: tiny, tokenizer: byte}
    optimizer:   {type: AdamW, learning_rate: {type: warmup_cosine, peak: 3.0e-3, ...}}
    sparsity:    {algorithm: rigl, sparsity: 0.8, update: {freq: 20, stop: 150}}
    runconfig:   {max_steps: 200, eval_frequency: 50, checkpoint_steps: 100, seed: 0}
"""

from __future__ import annotations

import math
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, field_validator, model_validator

PresetName = Literal["tiny", "mini", "small"]
# Keys inside a sparsity config whose numeric values are sparsity levels.
SPARSITY_LEVEL_KEYS = ("sparsity", "init_sparsity", "end_sparsity", "value", "init", "final",
                       "minimum")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)


class InputSpec(_Section):
    data_dir: str | None = None  # eval_input: None means "the train_input data_dir"
    batch_size: PositiveInt = 16  # GLOBAL batch, split evenly over num_csx
    seq_len: PositiveInt = 64
    shuffle: bool = True


class TrainInputSpec(InputSpec):
    data_dir: str = "builtin:shakespeare"


class TokenizerSpec(_Section):
    type: Literal["byte", "bpe"] = "byte"
    vocab_size: PositiveInt | None = None  # bpe only


class ModelSpec(_Section):
    preset: PresetName | None = "tiny"
    # Sizes override the preset's (or set everything when preset is null).
    n_layer: PositiveInt | None = None
    n_head: PositiveInt | None = None
    d_model: PositiveInt | None = None
    d_ff: PositiveInt | None = None
    max_seq_len: PositiveInt | None = None
    tie_embeddings: bool | None = None
    sparse_wide_sparsity: float = Field(0.0, ge=0.0, lt=1.0)
    tokenizer: TokenizerSpec = TokenizerSpec()

    @field_validator("tokenizer", mode="before")
    @classmethod
    def _tokenizer_shorthand(cls, value: Any) -> Any:
        return {"type": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _sizes_without_preset(self) -> ModelSpec:
        if self.preset is None:
            missing = [n for n in ("n_layer", "n_head", "d_model", "d_ff") if getattr(self, n) is None]
            if missing:
                raise ValueError(f"model.preset is null, so model needs {', '.join(missing)}")
        return self

    def size_overrides(self) -> dict[str, Any]:
        names = ("n_layer", "n_head", "d_model", "d_ff", "max_seq_len", "tie_embeddings")
        overrides = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        if self.sparse_wide_sparsity:
            overrides["sparse_wide_sparsity"] = self.sparse_wide_sparsity
        return overrides


class WarmupCosineSpec(_Section):
    """Linear warmup from 0 to ``peak`` over ``warmup_steps``, then cosine down to ``minimum``
    at ``decay_steps`` (default: runconfig.max_steps), constant afterwards."""
    type: Literal["warmup_cosine"] = "warmup_cosine"
    peak: float = Field(gt=0.0)
    warmup_steps: NonNegativeInt = 0
    minimum: float = Field(0.0, ge=0.0)
    decay_steps: PositiveInt | None = None

    @model_validator(mode="after")
    def _minimum_below_peak(self) -> WarmupCosineSpec:
        if self.minimum > self.peak:
            raise ValueError(f"learning_rate.minimum ({self.minimum}) exceeds peak ({self.peak})")
        return self


class OptimizerSpec(_Section):
    type: str = "AdamW"  # any torch.optim class name, checked when the optimizer is built
    learning_rate: float | WarmupCosineSpec = 1e-3
    weight_decay: float = Field(0.0, ge=0.0)
    max_gradient_norm: float | None = Field(None, gt=0.0)
    betas: tuple[float, float] | None = None
    eps: float | None = Field(None, gt=0.0)
    momentum: float | None = Field(None, ge=0.0)

    @field_validator("learning_rate")
    @classmethod
    def _positive_rate(cls, value: float | WarmupCosineSpec) -> float | WarmupCosineSpec:
        if isinstance(value, float) and value <= 0:
            raise ValueError(f"learning_rate must be > 0, got {value}")
        return value

    def extra_kwargs(self) -> dict[str, Any]:
        """Optimizer options given in the spec (only those, so each class keeps its defaults)."""
        return {n: getattr(self, n) for n in ("betas", "eps", "momentum") if getattr(self, n) is not None}


class RunConfigSpec(_Section):
    max_steps: PositiveInt = 100
    eval_steps: PositiveInt = 10  # batches per evaluation
    eval_frequency: NonNegativeInt = 0  # 0: evaluate only at the end (train_and_eval)
    checkpoint_steps: NonNegativeInt = 0  # 0: checkpoint only at the end
    log_steps: PositiveInt = 10
    seed: int = 0
    num_csx: PositiveInt = Field(1, le=192)  # a CS-2 cluster has at most 192 systems
    max_failures: NonNegativeInt = 3
    mlflow_experiment: str = "csx-sparse"
    model_dir: str | None = None
    checkpoint_path: str | None = None  # start (train) or evaluate (eval) from this checkpoint
    # Kernel of the simulated fabric's sparse layers. "auto" is the simulator's rule, which is
    # calibrated by timing in each process: CSR and dense round differently, so bit-identical
    # results across processes (resume, replicas) need a fixed "csr" or "dense".
    sparse_kernel: Literal["auto", "csr", "dense"] = "auto"


def _check_sparsity_levels(value: Any, path: str) -> None:
    """Reject NaN anywhere and sparsity levels outside [0, 1), naming where they are."""
    if isinstance(value, bool):
        return
    if isinstance(value, float) and math.isnan(value):
        raise ValueError(f"{path} is NaN")
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}"
            if key in SPARSITY_LEVEL_KEYS:
                levels = item if isinstance(item, list) else [item]  # a list cycles through levels
                for index, level in enumerate(levels):
                    if isinstance(level, (int, float)) and not isinstance(level, bool):
                        _check_level(level, f"{where}[{index}]" if isinstance(item, list) else where)
            _check_sparsity_levels(item, where)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_sparsity_levels(item, f"{path}[{index}]")


def _check_level(level: float, where: str) -> None:
    if math.isnan(level) or not 0.0 <= level < 1.0:
        raise ValueError(f"{where} must be a sparsity level in [0, 1), got {level}")


class JobSpec(_Section):
    train_input: TrainInputSpec = TrainInputSpec()
    eval_input: InputSpec = InputSpec()
    model: ModelSpec = ModelSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    sparsity: float | dict[str, Any] | list[Any] | None = None
    runconfig: RunConfigSpec = RunConfigSpec()

    @field_validator("sparsity")
    @classmethod
    def _sparsity_levels(cls, value: Any) -> Any:
        if isinstance(value, float):
            _check_level(value, "sparsity")
        else:
            _check_sparsity_levels(value, "sparsity")
        return value

    @classmethod
    def from_yaml(cls, text: str) -> JobSpec:
        """Parse params YAML; a YAML or field error raises ValueError naming the problem."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"params YAML does not parse: {err}") from err
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(f"params YAML must be a mapping of sections, got {type(data).__name__}")
        return cls.model_validate(data)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def eval_data_dir(self) -> str:
        return self.eval_input.data_dir or self.train_input.data_dir
