"""The ``optimizer`` and ``runconfig`` sections of the params layout with ModelZoo's key names
(``model`` is csx_config/model.py's, the input sections csx_config/inputs.py's), the batch
rule, and the range checks of the ``sparsity`` section (passed unchanged to
``sparsity.configure``).

Keys that only mean something on real Cerebras hardware (``mixed_precision``, ``num_workers``,
``use_cs_grad_accum``, ...) are accepted, kept in the spec, and listed by ``not_applied()``.
Any other unknown key is an error naming it (csx_config.keys), reported together with every
other problem of its section. Our own additions, all optional: ``data_dir:
builtin:shakespeare``, and runconfig's ``num_csx`` cap, ``max_failures``, ``mlflow_experiment``,
``sparse_kernel``, ``torch_compile`` and the hardware of each system (``cpus_per_csx``,
``gpus_per_csx``, ``placement_strategy``).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator

from csx_config.keys import Section
from csx_config.schedulers import LearningRate, SchedulerSpec, check_sequence

# A CS-2 cluster has at most 192 systems.
MAX_CSX = 192
# The states of a checkpoint, by ModelZoo's names (a 2.x checkpoint calls its LR schedulers
# "schedulers", earlier ones "lr_scheduler"), and csx's own "rng" (the dropout generator).
CHECKPOINT_STATES = ("model", "optimizer", "lr_scheduler", "schedulers", "sparsity", "dataloader",
                     "global_step", "grad_scaler", "rng")
# Keys inside a sparsity config whose numeric values are sparsity levels.
SPARSITY_LEVEL_KEYS = ("sparsity", "init_sparsity", "end_sparsity", "value", "init", "final",
                       "minimum")


# ModelZoo's lr_adjustment_groups, in its order: the parameter globs of each named group.
LR_ADJUSTMENT_GROUPS: dict[str, tuple[str, ...]] = {
    "embedding": ("*embedding*weight",),
    "decoder_kernel": ("*decoder*dense*weight", "*decoder*linear*weight"),  # the 1.x muP group
    "decoder_attention": ("*decoder*attn*dense*weight",),
    "decoder_input_ffn": ("*decoder*ffn.ffn.[!1]*weight",),
    "decoder_output_ffn": ("*decoder*ffn.ffn.[1]*weight",),
}


class OptimizerSpec(Section):
    """The ``optimizer`` section: a ``torch.optim`` class by name, its learning rate (a number
    or a list of cstorch schedulers run one after another), weight decay, gradient clipping
    and per-group learning-rate factors."""

    SECTION = "optimizer"
    NOT_APPLIED = frozenset({"log_summaries", "loss_scaling_factor", "initial_loss_scale",
                             "steps_per_increase", "min_loss_scale", "max_loss_scale",
                             "grad_accum_steps"})
    ALIASES = {"weight_decay_rate": "weight_decay"}
    optimizer_type: str = "AdamW"  # a torch.optim class name (any case), checked when built
    learning_rate: LearningRate = 1e-3
    weight_decay: float = Field(0.0, ge=0.0)
    max_gradient_norm: float | None = Field(None, gt=0.0)
    betas: tuple[float, float] | None = None
    eps: float | None = Field(None, gt=0.0)
    momentum: float | None = Field(None, ge=0.0)
    correct_bias: bool = True
    # Learning-rate factor per parameter group (ModelZoo's 1.x muP files: {decoder_kernel: 0.1}).
    adjust_learning_rate: dict[str, float] | None = None

    @field_validator("adjust_learning_rate")
    @classmethod
    def _known_groups(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for group, factor in (value or {}).items():
            if group not in LR_ADJUSTMENT_GROUPS:
                raise ValueError(f"adjust_learning_rate.{group} is not one of {list(LR_ADJUSTMENT_GROUPS)}")
            if not factor > 0:
                raise ValueError(f"adjust_learning_rate.{group} must be > 0, got {factor}")
        return value

    @field_validator("learning_rate")
    @classmethod
    def _valid_rate(cls, value: LearningRate) -> LearningRate:
        if isinstance(value, SchedulerSpec) and value.is_constant():
            value = value.learning_rate  # one spec for one job, however the file spells it
        if isinstance(value, float) and value <= 0:
            raise ValueError(f"learning_rate must be > 0, got {value}")
        if isinstance(value, list):
            check_sequence(value)
        return value

    @field_validator("correct_bias")
    @classmethod
    def _bias_corrected(cls, value: bool) -> bool:
        if not value:
            raise ValueError("correct_bias: false is not supported (torch's Adam/AdamW always correct bias)")
        return value

    def extra_kwargs(self) -> dict[str, Any]:
        """Optimizer options given in the spec (only those, so each class keeps its defaults)."""
        return {n: getattr(self, n) for n in ("betas", "eps", "momentum") if getattr(self, n) is not None}


class RunConfigSpec(Section):
    """The ``runconfig`` section: steps (``max_steps``, evaluation, checkpoint and logging
    cadences, all in optimizer steps), the seed, ``num_csx`` (1 to 192 systems) and where the
    run's model and MLflow experiment go."""

    SECTION = "runconfig"
    NOT_APPLIED = frozenset({
        "enable_distributed", "precision_opt_level", "use_cs_grad_accum",
        "use_appliance_data", "compile_only", "validate_only", "mode", "num_workers_per_csx",
        "num_wgt_servers", "num_act_servers", "credentials_path", "mount_dirs", "python_paths",
        "job_labels", "target_device", "autoload_last_checkpoint", "disable_version_check",
        "dist_backend", "init_method", "sync_batchnorm", "log_summaries", "mgmt_address",
        "job_time_sec", "transfer_processes", "experimental", "dump_activations",
        "log_input_summaries", "check_loss_values", "lora", "op_profiler_config",
        "execute_crd_memory_gi", "compile_crd_memory_gi", "wrk_memory_gi", "act_memory_gi",
        "cmd_memory_gi", "wgt_memory_gi", "num_steps", "num_epochs", "steps_per_epoch",
        "keep_last_n_checkpoints", "keep_checkpoint_max", "save_summary_steps",
        # trainer-layout homes of the CS appliance's settings (csx_config.trainer)
        "compile_dir", "mgmt_namespace", "cbcore_image", "job_priority", "main_process_id",
        "logging", "wsc_log_level", "enable_act_frequency", "ini", "debug_args",
        "retrace_every_iteration", "lazy_initialization", "log_initialization", "drop_data",
        "fabric_type_blacklist", "chf_memory_gi", "debug_args_path", "summary_dir",
        "legacy_event_dirs", "hf_cache_dir"})
    ALIASES = {"save_checkpoint_steps": "checkpoint_steps"}
    max_steps: PositiveInt = 100
    eval_steps: PositiveInt = 10  # batches per evaluation
    eval_frequency: NonNegativeInt | None = 0  # 0 / null: evaluate only at the end (train_and_eval)
    checkpoint_steps: NonNegativeInt | None = 0  # 0 / null: checkpoint only at the end
    log_steps: PositiveInt = 10
    seed: int = 0
    num_csx: PositiveInt = Field(1, le=MAX_CSX)
    max_failures: NonNegativeInt = 3
    mlflow_experiment: str = "csx-sparse"
    model_dir: str | None = None
    checkpoint_path: str | None = None  # start (train) or evaluate (eval) from this checkpoint
    # ModelZoo's checkpoint keys, applied as its trainer applies them (training/checkpoint.py):
    # which states of checkpoint_path a training run loads ("all", or names: "model" alone
    # starts from its weights at step 0), whether a checkpoint may lack or add model tensors,
    # and a checkpoint of the state training starts from, before its first step.
    load_checkpoint_states: str | list[str] = "all"
    disable_strict_checkpoint_loading: bool = False
    save_initial_checkpoint: bool = False
    # Kernel of the simulated fabric's sparse layers. "auto" is the simulator's rule, which is
    # calibrated by timing in each process: CSR and dense round differently, so bit-identical
    # results across processes (resume, replicas) need a fixed "csr" or "dense".
    sparse_kernel: Literal["auto", "csr", "dense"] = "auto"
    # torch.compile the model's forward: "auto" on CUDA, where the fabric's CSR layers do not
    # run (training.build.compiles); true also on a CPU (a dense run there).
    torch_compile: Literal["auto"] | bool = "auto"
    # Hardware of each simulated system, requested from Ray per worker. None: the cluster's
    # CPUs shared by the job's systems, and one GPU each where there are enough.
    # The worker's torch intra-op threads (CSR kernels included) equal its CPUs.
    cpus_per_csx: PositiveInt | None = None
    gpus_per_csx: NonNegativeInt | None = None  # 0: train on CPUs even where GPUs exist
    # Ray placement of the job's systems: PACK on as few nodes as fit, SPREAD over nodes.
    placement_strategy: Literal["PACK", "SPREAD"] = "PACK"

    @field_validator("load_checkpoint_states")
    @classmethod
    def _known_states(cls, value: str | list[str]) -> str | list[str]:
        checkpoint_states(value)
        return value


def checkpoint_states(value: str | list[str]) -> frozenset[str] | None:
    """``load_checkpoint_states`` as the set of ModelZoo state names it selects (None: "all"),
    read as ModelZoo reads it: "all", a comma-separated string, or a list of names."""
    if isinstance(value, str) and value.strip().lower() == "all":
        return None
    names = [name.strip() for name in value.split(",")] if isinstance(value, str) else list(value)
    unknown = [name for name in names if name not in CHECKPOINT_STATES]
    if not names or unknown:
        raise ValueError(f"load_checkpoint_states: {unknown or value!r} not among the states of a "
                         f"checkpoint; give 'all' or names from {list(CHECKPOINT_STATES)}")
    return frozenset(names)


def batch_split_problem(batch_size: int, num_csx: int, section: str = "train_input") -> str | None:
    """Why a global batch cannot split over `num_csx` systems, or None: each system takes an
    equal slice (the schema, the service's options and every plan ask this)."""
    if batch_size % num_csx == 0:
        return None
    return (f"{section}.batch_size ({batch_size}) must divide evenly over num_csx ({num_csx}): "
            "each system takes an equal slice of the global batch")


def check_sparsity_levels(value: Any, path: str) -> None:
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
                        check_level(level, f"{where}[{index}]" if isinstance(item, list) else where)
            check_sparsity_levels(item, where)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_sparsity_levels(item, f"{path}[{index}]")


def check_level(level: float, where: str) -> None:
    if math.isnan(level) or not 0.0 <= level < 1.0:
        raise ValueError(f"{where} must be a sparsity level in [0, 1), got {level}")
