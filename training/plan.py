"""The plan of a job: what it will run, resolved once from its spec where the spec is admitted
(``csx run``, the service's scheduler) and carried from there to the runner, each Ray worker
and the loop, which read the plan and never the spec.

``plan_job`` is where the rules of a job's shape are checked, each once: the number of systems
(1 to ``csx_config.MAX_CSX``), the global batches splitting evenly over them
(``csx_config.batch_split_problem``, also the schema's check), the model keys together
(``models.config.ModelConfig``) and its sequences fitting the position table. What needs the
data or torch is checked where it is read (the data: training/data.py) or planned (the layers
and their sparsity groups: training/report.py); what needs the machine is the memory rule
(training/memory.py), asked at each admission with that machine's limits.

No torch: a plan is made without loading it (its report, training/report.py, needs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from csx_config import MAX_CSX, JobSpec, OptimizerSpec, batch_split_problem
from csx_config.schedulers import warmup_steps
from csx_config.sections import checkpoint_states
from models.config import ModelConfig
from training.data import DataPlan, eval_source, input_plan, planned_shapes

MODES = ("train", "eval", "train_and_eval", "eval_all")


@dataclass(frozen=True)
class LoopSettings:
    """What the training loop reads besides the model, optimizer, sparsity and data."""

    max_steps: int
    log_steps: int
    eval_frequency: int | None  # 0 / None: evaluate only at the end (train_and_eval)
    checkpoint_steps: int | None  # 0 / None: checkpoint only at the end
    checkpoint_path: str | None  # start (train) or evaluate (eval) from this checkpoint
    load_checkpoint_states: frozenset[str] | None  # of checkpoint_path; None: all of them
    strict_checkpoint_loading: bool
    save_initial_checkpoint: bool
    sparse_kernel: str
    torch_compile: bool | str  # "auto": on CUDA where no fabric layer runs (training.build.fabric_layers)
    global_batch_size: int
    max_gradient_norm: float | None
    warmup_steps: int
    spec_json: dict[str, Any]  # the admitted spec, saved in every checkpoint
    params_yaml: str  # the same, written beside the checkpoints

    @property
    def sparsity_section(self) -> Any:
        """The spec's sparsity section as checkpoints record it (a changed one starts a new
        pruning phase)."""
        return self.spec_json["sparsity"]


@dataclass(frozen=True)
class HardwareRequest:
    """What each system asks of the Ray cluster (None: the cluster's share, workers/hardware.py)."""

    cpus_per_csx: int | None
    gpus_per_csx: int | None
    placement: str  # PACK or SPREAD


@dataclass(frozen=True)
class JobPlan:
    """A job as admitted. ``model`` holds the vocabulary planned from the spec; a text run's
    tokenizer gives the one it trains with (training.data.load_data)."""

    num_csx: int
    seed: int
    model: ModelConfig
    data: DataPlan
    optimizer: OptimizerSpec
    sparsity: Any  # the sparsity section, the job's seed its default; None: dense
    precision_keys: tuple[dict[str, Any], dict[str, Any]]  # model's and optimizer's (training.precision)
    loop: LoopSettings
    hardware: HardwareRequest
    max_failures: int
    experiment: str
    not_applied: dict[str, str]  # hardware-only keys of the file, with the reason
    upgrades: tuple[str, ...]  # how the file's deprecated keys were read

    @property
    def batch_per_csx(self) -> int:
        return self.data.train.batch_size // self.num_csx


def plan_job(spec: JobSpec, num_csx: int | None = None, *, experiment: str | None = None,
             max_failures: int | None = None) -> JobPlan:
    """The plan of `spec` on `num_csx` systems (default runconfig's), logging to `experiment`
    and restarting lost workers up to `max_failures` times (defaults: runconfig's); ValueError
    names the problem."""
    rc = spec.runconfig
    num_csx = rc.num_csx if num_csx is None else num_csx
    if not isinstance(num_csx, int) or isinstance(num_csx, bool) or not 1 <= num_csx <= MAX_CSX:
        raise ValueError(f"num_csx must be an integer in [1, {MAX_CSX}], got {num_csx!r}")
    for section in ("train_input", "eval_input"):
        problem = batch_split_problem(getattr(spec, section).batch_size, num_csx, section)
        if problem:
            raise ValueError(problem)
    max_failures = rc.max_failures if max_failures is None else max_failures
    if max_failures < 0:
        raise ValueError(f"max_failures must be >= 0, got {max_failures}")
    # The spec as it runs, for the record: the systems and experiment it was admitted with.
    record = spec.model_copy(deep=True)
    record.runconfig.num_csx = num_csx
    if experiment is not None:
        record.runconfig.mlflow_experiment = experiment
    rc = record.runconfig
    vocab_size, seq_len = planned_shapes(record)
    return JobPlan(
        num_csx=num_csx, seed=rc.seed, model=model_config(record, vocab_size, seq_len),
        data=data_plan(record, seq_len), optimizer=record.optimizer,
        sparsity=None if record.sparsity is None else with_defaults(record.sparsity, {"seed": rc.seed}),
        precision_keys=(dict(record.model.model_extra or {}), dict(record.optimizer.model_extra or {})),
        loop=loop_settings(record),
        hardware=HardwareRequest(rc.cpus_per_csx, rc.gpus_per_csx, rc.placement_strategy),
        max_failures=max_failures, experiment=rc.mlflow_experiment,
        not_applied=record.not_applied_reasons(), upgrades=tuple(record.upgrades()))


def model_config(spec: JobSpec, vocab_size: int, seq_len: int) -> ModelConfig:
    """The model keys (file, else preset, else ModelZoo default) with the data's vocabulary;
    the sequences must fit the position table."""
    config = ModelConfig(**{**spec.model.resolved(), "vocab_size": vocab_size})
    if seq_len > config.max_position_embeddings:
        sinks = spec.train_input.added_tokens()
        what = (f"samples of {seq_len - sinks} tokens and {sinks} sink tokens (data_transforms) exceed" if sinks
                else f"the sequence length ({seq_len}) exceeds")
        raise ValueError(f"train_input: {what} model.max_position_embeddings ({config.max_position_embeddings})")
    return config


def data_plan(spec: JobSpec, seq_len: int) -> DataPlan:
    seed = spec.runconfig.seed
    resolved = spec.model.resolved()
    return DataPlan(train=input_plan(spec.train_input, spec.train_input, seed),
                    eval=input_plan(spec.eval_input, eval_source(spec), seed),
                    eval_steps=spec.runconfig.eval_steps, tokenizer=spec.model.tokenizer,
                    requested_vocab_size=spec.model.vocab_size, model_vocab_size=resolved["vocab_size"],
                    max_position_embeddings=resolved["max_position_embeddings"], seq_len=seq_len)


def loop_settings(spec: JobSpec) -> LoopSettings:
    rc = spec.runconfig
    return LoopSettings(max_steps=rc.max_steps, log_steps=rc.log_steps,
                        eval_frequency=rc.eval_frequency, checkpoint_steps=rc.checkpoint_steps,
                        checkpoint_path=rc.checkpoint_path,
                        load_checkpoint_states=checkpoint_states(rc.load_checkpoint_states),
                        strict_checkpoint_loading=not rc.disable_strict_checkpoint_loading,
                        save_initial_checkpoint=rc.save_initial_checkpoint, sparse_kernel=rc.sparse_kernel,
                        torch_compile=rc.torch_compile, global_batch_size=spec.train_input.batch_size,
                        max_gradient_norm=spec.optimizer.max_gradient_norm,
                        warmup_steps=warmup_steps(spec.optimizer.learning_rate),
                        spec_json=spec.model_dump(mode="json"), params_yaml=spec.to_yaml())


def with_defaults(config: Any, defaults: dict[str, Any], override: bool = False) -> Any:
    """The sparsity section with ``defaults`` in every group (the section's own values win
    unless ``override``)."""
    if isinstance(config, (int, float)):
        return {"sparsity": config, **defaults}
    if isinstance(config, list):
        return [with_defaults(group, defaults, override) if isinstance(group, dict) else group
                for group in config]
    return {**config, **defaults} if override else {**defaults, **config}

