"""The sections of the params layout (``train_input``, ``eval_input``, ``model``,
``optimizer``, ``runconfig``) with ModelZoo's key names, and the range checks of the
``sparsity`` section (passed unchanged to ``sparsity.configure``).

Keys that only mean something on real Cerebras hardware (``mixed_precision``, ``num_workers``,
``use_cs_grad_accum``, ...) are accepted, kept in the spec, and listed by ``not_applied()``.
Any other unknown key is an error naming it (csx_config.keys), reported together with every
other problem of its section. Our own additions, all optional: ``model.preset`` (tiny / mini /
small: a small Llama filling the size keys the file does not give), ``model.tokenizer`` and
``model.sparse_wide_sparsity``, ``data_dir: builtin:shakespeare``, and runconfig's ``num_csx``
cap, ``max_failures``, ``mlflow_experiment``, ``sparse_kernel``, ``torch_compile`` and the hardware of each system
(``cpus_per_csx``, ``gpus_per_csx``, ``placement_strategy``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationError, field_validator,
                      model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError

from csx_config.keys import EXTRA_NOT_APPLIED, HARDWARE_ONLY, NOT_APPLIED_REASONS, validate_all_keys
from csx_config.schedulers import LearningRate, SchedulerSpec, check_sequence, rename_aliases

PresetName = Literal["tiny", "mini", "small"]
# model.nonlinearity: the gated (GLU) ones and all of them.
GLU_NONLINEARITIES = ("swiglu", "geglu", "reglu")
NONLINEARITIES = ("gelu", "gelu_new", "relu", "silu", "swish", *GLU_NONLINEARITIES)
HDF5_PROCESSORS = ("GptHDF5DataProcessor", "GptHDF5MapDataProcessor")
# ModelZoo data processors of models not built here, with what they read.
PROCESSORS_NOT_BUILT = {"DpoHDF5DataProcessor": "preference pairs for DPO"}
# Keys inside a sparsity config whose numeric values are sparsity levels.
SPARSITY_LEVEL_KEYS = ("sparsity", "init_sparsity", "end_sparsity", "value", "init", "final",
                       "minimum")


class _Section(BaseModel):
    """A params section: its fields, plus the hardware-only keys it accepts without applying
    (kept as pydantic extras, so the stored spec is the user's file)."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, validate_assignment=True)
    SECTION: ClassVar[str] = ""
    NOT_APPLIED: ClassVar[frozenset[str]] = frozenset()
    ALIASES: ClassVar[dict[str, str]] = {}  # another ModelZoo spelling -> field

    @model_validator(mode="wrap")
    @classmethod
    def _known_keys(cls, data: Any, handler: Any) -> Any:
        if isinstance(data, dict):
            data = rename_aliases(data, cls.ALIASES, prefix=f"{cls.SECTION}: ")
        return validate_all_keys(cls, data, handler, cls.known_keys(), cls.SECTION)

    @classmethod
    def known_keys(cls) -> set[str]:
        return (set(cls.model_fields) | cls.NOT_APPLIED | EXTRA_NOT_APPLIED.get(cls.SECTION, frozenset())
                | set(cls.ALIASES))

    def not_applied(self) -> dict[str, str]:
        """This section's keys accepted without effect here, each with the reason."""
        return {f"{self.SECTION}.{key}": NOT_APPLIED_REASONS.get(f"{self.SECTION}.{key}", HARDWARE_ONLY)
                for key in (self.model_extra or {})}


class InputSpec(_Section):
    """The ``eval_input`` section: which data, and how it is batched (``batch_size`` is the
    global batch in samples, split evenly over ``num_csx``). Hardware-only keys are accepted
    and listed as not applied."""

    SECTION = "eval_input"
    NOT_APPLIED = frozenset({
        "num_workers", "prefetch_factor", "persistent_workers", "micro_batch_size", "use_worker_cache",
        "shuffle_buffer", "repeat", "drop_last", "mixed_precision", "use_vsl", "pad_last",
        "vocab_size", "num_samples"})
    data_processor: str | None = None  # None: HDF5 when data_dir holds .h5 files, else text
    data_dir: str | list[str] | None = None  # eval_input: None means "the train_input data_dir"
    batch_size: PositiveInt = 16  # GLOBAL batch, split evenly over num_csx
    max_sequence_length: PositiveInt | None = None  # None: the HDF5 data's, else the model's
    shuffle: bool = False
    shuffle_seed: int | None = None  # None: runconfig.seed

    @field_validator("data_processor")
    @classmethod
    def _known_processor(cls, value: str | None) -> str | None:
        choices = (*HDF5_PROCESSORS, "TextDataProcessor")
        if value is not None and value not in choices:
            what = f" ({PROCESSORS_NOT_BUILT[value]})" if value in PROCESSORS_NOT_BUILT else ""
            raise ValueError(f"data_processor {value!r}{what} is not supported here; choose one of {list(choices)}")
        return value

    @field_validator("data_dir")
    @classmethod
    def _non_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and not value:
            raise ValueError("data_dir is an empty list")
        return value

    def data_dirs(self) -> list[str]:
        return [] if self.data_dir is None else [self.data_dir] if isinstance(self.data_dir, str) else list(self.data_dir)


class TrainInputSpec(InputSpec):
    """The ``train_input`` section: as [`InputSpec`][csx_config.InputSpec], with the training
    data (default ``builtin:shakespeare``), shuffled by default."""

    SECTION = "train_input"
    data_dir: str | list[str] = "builtin:shakespeare"
    shuffle: bool = True


class TokenizerSpec(_Section):
    """For text data (HDF5 data is already tokenized): bytes, a BPE trained on the train split
    (``vocab_size``), or a BPE read from a local file (``vocab_file``: a tokenizers JSON, or a
    GPT-2 ``vocab.json`` with ``merges_file``)."""
    SECTION = "model.tokenizer"
    type: Literal["byte", "bpe"] = "byte"
    vocab_size: PositiveInt | None = None
    vocab_file: str | None = None
    merges_file: str | None = None


Initializer = dict[str, Any]


def check_initializer(value: Initializer | None) -> Initializer | None:
    if value is not None and value.get("name") not in INITIALIZERS:
        raise ValueError(f"initializer name {value.get('name')!r} is not one of {list(INITIALIZERS)}")
    return value


class ExtraAttentionParams(_Section):
    """``model.extra_attention_params``: ``num_kv_groups`` key/value heads for
    ``attention_module: multiquery_attention`` (1: multi-query; fewer than num_heads: GQA)."""
    SECTION = "model.extra_attention_params"
    num_kv_groups: PositiveInt | None = None


class MoESpec(_Section):
    """``model.moe`` (``moe_params`` before 2.4): a mixture of ``num_experts`` FFN experts, each
    token routed to ``top_k`` of them by a learned router, plus ``num_shared_experts`` every
    token passes through; ``load_balancing_loss_coef`` weighs the router's balance loss."""
    SECTION = "model.moe"
    NOT_APPLIED = frozenset({"moe_implementation"})
    num_experts: PositiveInt = 1
    top_k: PositiveInt = 1
    num_shared_experts: PositiveInt | None = None
    load_balancing_loss_coef: float = Field(0.0, ge=0.0)
    null_expert_bias: float | None = Field(None, ge=0.0)
    router_fp32: bool = True
    routing_algorithm: Literal["learned"] = "learned"
    router_selection_nonlinearity: Literal["softmax"] = "softmax"
    expert_weighting_nonlinearity: Literal["softmax"] = "softmax"
    expert_weighting_normalization: bool = True
    gate_initializer: Initializer | None = None

    @field_validator("gate_initializer")
    @classmethod
    def _initializer_named(cls, value: Initializer | None) -> Initializer | None:
        return check_initializer(value)

    @model_validator(mode="after")
    def _experts_cover_top_k(self) -> MoESpec:
        if self.top_k > self.num_experts:
            raise ValueError(f"model.moe.top_k ({self.top_k}) must be at most num_experts ({self.num_experts})")
        return self


# model.name -> the ModelZoo model class it selects (the class decides the decoder block).
MODEL_CLASSES: dict[str, str] = {
    **dict.fromkeys(("gpt2", "gpt3", "llama", "mistral", "btlm", "bloom", "jais", "starcoder",
                     "santacoder", "mpt", "gemma2", "mixtral"), "GPT2LMHeadModel"),
    "gptj": "GPTJModel", "falcon": "GPTJModel"}
# ModelZoo model classes csx does not build, with what each is.
MODELS_NOT_BUILT: dict[str, str] = {
    "dpo": "DPO (a policy model and a frozen reference model trained on preference pairs)",
    "bert": "BERT (an encoder)", "t5": "T5 (an encoder-decoder)", "transformer": "the encoder-decoder Transformer",
    "llava": "LLaVA (a multimodal model)", "multimodal_simple": "a multimodal model", "esm2": "ESM-2 (an encoder)",
    "dpr": "DPR (a retrieval encoder pair)"}
# Keys only the parallel-block GPTJModel reads (GPT-J, GPT-NeoX, Falcon), and the keys only
# GPT2LMHeadModel reads: a file that names the other class is told which family a key is of.
CLASS_KEYS: dict[str, frozenset[str]] = {
    "GPTJModel": frozenset({"use_untied_layer_norm", "residual_dropout_rate"}),
    "GPT2LMHeadModel": frozenset({
        "norm_first_sandwich", "attention_logit_softcapping", "final_logit_softcapping",
        "sliding_window_every_other_decoder_layer", "scale_qk_dot_by_layer_idx", "scale_by_layer_index"}),
}
CLASS_FAMILIES = {"GPTJModel": "parallel-block key of GPT-J/NeoX/Falcon (model.name: gptj or falcon)",
                  "GPT2LMHeadModel": "key of GPT2LMHeadModel (GPT-2/3, Llama, StarCoder, Gemma-2, Mixtral...)"}


def model_class_problems(data: dict[str, Any]) -> tuple[str, list[tuple[tuple[str, ...], str]]]:
    """The model class a model section selects (``model.name``, else the class whose own keys it
    uses) and its keys that class does not read, each naming the family it belongs to."""
    name = data.get("name")
    given = {key for key, value in data.items() if value is not None}  # a dumped spec holds None for unset
    if isinstance(name, str) and name in MODEL_CLASSES:
        chosen = MODEL_CLASSES[name]
    else:
        chosen = "GPTJModel" if CLASS_KEYS["GPTJModel"] & given else "GPT2LMHeadModel"
    reader = f"model.name={name} ({chosen})" if name is not None else f"{chosen} (chosen by this file's keys)"
    problems = [((key,), f"model.{key}: {CLASS_FAMILIES[other]}, not read by {reader}")
                for other, keys in CLASS_KEYS.items() if other != chosen for key in sorted(given & keys)]
    return chosen, problems


class ModelSpec(_Section):
    """ModelZoo's decoder LM keys: GPT2LMHeadModel's (GPT-2/3, BTLM, Bloom, Jais, Llama, Mistral,
    StarCoder, MPT, Gemma-2, Mixtral) and GPTJModel's (GPT-J, GPT-NeoX, Falcon), the class
    chosen by ``name``. Unset keys take the preset's value, else ModelZoo's default
    (``MODELZOO_DEFAULTS``)."""
    SECTION = "model"
    NOT_APPLIED = frozenset({
        "mixed_precision", "fp16_type", "use_bfloat16", "precision_opt_level", "loss_scaling",
        "loss_weight", "attention_softmax_fp32", "fold_rope_consts", "attention_kernel",
        "boundary_casting", "tf_summary", "dtype", "label_smoothing", "z_loss_eps"})
    ALIASES = {"residual_dropout_rate": "dropout_rate", "scale_by_layer_index": "scale_qk_dot_by_layer_idx",
               "moe_params": "moe"}
    name: str | None = None  # the ModelZoo model class (MODEL_CLASSES); None: from the keys
    preset: PresetName | None = None
    vocab_size: PositiveInt | None = None
    hidden_size: PositiveInt | None = None
    num_hidden_layers: PositiveInt | None = None
    num_heads: PositiveInt | None = None
    filter_size: PositiveInt | None = None
    max_position_embeddings: PositiveInt | None = None
    position_embedding_type: Literal["learned", "rotary", "alibi"] | None = None
    rotary_dim: PositiveInt | None = None
    rope_theta: float | None = Field(None, gt=0.0)
    pos_scaling_factor: float | None = Field(None, gt=0.0)
    pos_scaling_type: Literal["linear", "llama3", "yarn", "YaRN"] | None = None
    pos_scaling_extra_args: dict[str, float | int | bool] | None = None
    alibi_trainable_slopes: bool | None = None
    share_embedding_weights: bool | None = None
    embedding_layer_norm: bool | None = None
    nonlinearity: Literal[NONLINEARITIES] | None = None
    norm_type: Literal["layernorm", "rmsnorm", "biasless-layernorm"] | None = None
    layer_norm_epsilon: float | None = Field(None, gt=0.0)
    attention_type: Literal["scaled_dot_product", "dot_product"] | None = None
    attention_module: Literal["aiayn_attention", "multiquery_attention"] | None = None
    extra_attention_params: ExtraAttentionParams | None = None
    attention_inner_dim: PositiveInt | None = None
    attention_sliding_window_length: PositiveInt | None = None
    attention_sink_tokens: NonNegativeInt | None = None
    use_projection_bias_in_attention: bool | None = None
    use_ffn_bias_in_attention: bool | None = None
    use_ffn_bias: bool | None = None
    use_bias_in_output: bool | None = None
    dropout_rate: float | None = Field(None, ge=0.0, lt=1.0)
    attention_dropout_rate: float | None = Field(None, ge=0.0, lt=1.0)
    embedding_dropout_rate: float | None = Field(None, ge=0.0, lt=1.0)
    initializer_range: float | None = Field(None, gt=0.0)
    embedding_initializer: Initializer | None = None
    initializer: Initializer | None = None
    output_layer_initializer: Initializer | None = None
    mup_base_hidden_size: float | None = Field(None, gt=0.0)
    mup_base_filter_size: float | None = Field(None, gt=0.0)
    embeddings_scale: float | None = Field(None, gt=0.0)
    output_logits_alpha: float | None = Field(None, gt=0.0)
    scale_output_logits_by_d: bool | None = None
    output_logits_scale: float | None = Field(None, gt=0.0)
    scale_qk_dot_by_d: bool | None = None
    attention_logits_alpha: float | None = Field(None, gt=0.0)
    use_untied_layer_norm: bool | None = None  # GPTJModel: separate norms before attention and FFN
    scale_qk_dot_by_layer_idx: bool | None = None
    attention_logit_softcapping: float | None = Field(None, gt=0.0)
    final_logit_softcapping: float | None = Field(None, gt=0.0)
    norm_first_sandwich: bool | None = None
    sliding_window_every_other_decoder_layer: bool | None = None
    moe: MoESpec | None = None
    sparse_wide_sparsity: float = Field(0.0, ge=0.0, lt=1.0)
    tokenizer: TokenizerSpec = TokenizerSpec()

    @model_validator(mode="wrap")
    @classmethod
    def _known_keys(cls, data: Any, handler: Any) -> Any:
        """The model class first: a class not built is refused in one message naming it, and a
        key of the other class names the family it belongs to."""
        if not isinstance(data, dict):
            return handler(data)
        name = "dpo" if "dpo" in data else data.get("name")  # 2.x DPO files give model.dpo, no name
        if name is not None and (not isinstance(name, str) or name not in MODEL_CLASSES):
            what = MODELS_NOT_BUILT.get(name) if isinstance(name, str) else None
            message = (f"model.name: ModelZoo's {name} model, {what}, is not supported here" if what else
                       f"model.name {name!r} is not a ModelZoo decoder LM; one of {sorted(MODEL_CLASSES)}")
            raise ValidationError.from_exception_data(cls.__name__, [InitErrorDetails(
                type=PydanticCustomError("not_supported", "{message}", {"message": message}),
                loc=("name",), input=name)])
        chosen, problems = model_class_problems(data)
        if "residual_dropout_rate" in data and data.get("dropout_rate") == data["residual_dropout_rate"]:
            data = {k: v for k, v in data.items() if k != "residual_dropout_rate"}  # Falcon gives both
        data = rename_aliases({k: v for k, v in data.items() if (k,) not in dict(problems)},
                              cls.ALIASES, prefix="model: ")
        if chosen == "GPTJModel":  # kept in the spec, so the class survives a dump without a name
            data.setdefault("use_untied_layer_norm", False)
        return validate_all_keys(cls, data, handler, cls.known_keys(), cls.SECTION, problems)

    @property
    def model_class(self) -> str:
        """ModelZoo's model class: ``name``'s, else GPTJModel when its keys are given."""
        if self.name in MODEL_CLASSES:
            return MODEL_CLASSES[self.name]
        return "GPT2LMHeadModel" if self.use_untied_layer_norm is None else "GPTJModel"

    @field_validator("tokenizer", mode="before")
    @classmethod
    def _tokenizer_shorthand(cls, value: Any) -> Any:
        return {"type": value} if isinstance(value, str) else value

    @field_validator("embedding_initializer", "initializer", "output_layer_initializer")
    @classmethod
    def _initializer_named(cls, value: Initializer | None) -> Initializer | None:
        return check_initializer(value)

    def resolved(self) -> dict[str, Any]:
        """Every key the built model reads (``MODEL_KEYS``) with its value: the file's, else the
        preset's, else ModelZoo's."""
        values = dict(MODEL_KEYS)
        if self.preset:
            values.update(PRESETS[self.preset])
        values.update({k: getattr(self, k) for k in MODELZOO_DEFAULTS if getattr(self, k) is not None})
        if self.extra_attention_params is not None:
            values["extra_attention_params"] = self.extra_attention_params.model_dump(exclude_none=True)
        if self.moe is not None:
            values["moe"] = self.moe.model_dump(exclude_none=True)
        values["model_class"] = self.model_class
        values["sparse_wide_sparsity"] = self.sparse_wide_sparsity
        return values


# ModelZoo's lr_adjustment_groups, in its order: the parameter globs of each named group.
LR_ADJUSTMENT_GROUPS: dict[str, tuple[str, ...]] = {
    "embedding": ("*embedding*weight",),
    "decoder_kernel": ("*decoder*dense*weight", "*decoder*linear*weight"),  # the 1.x muP group
    "decoder_attention": ("*decoder*attn*dense*weight",),
    "decoder_input_ffn": ("*decoder*ffn.ffn.[!1]*weight",),
    "decoder_output_ffn": ("*decoder*ffn.ffn.[1]*weight",),
}
# torch.nn.init names a ModelZoo initializer may use, with the keys each takes besides "name".
INITIALIZERS = {"normal": ("mean", "std"), "truncated_normal": ("mean", "std", "a", "b"),
                "variance_scaling": ("scale", "mode", "distribution"),
                "uniform": ("a", "b"), "xavier_uniform": ("gain",), "xavier_normal": ("gain",),
                "zeros": (), "ones": ()}
# GPT2LMHeadModelConfig's defaults (ModelZoo 2.x).
MODELZOO_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50257, "hidden_size": 768, "num_hidden_layers": 12, "num_heads": 12,
    "filter_size": 3072, "max_position_embeddings": 1024, "position_embedding_type": "learned",
    "rotary_dim": None, "rope_theta": 10000.0, "pos_scaling_factor": 1.0, "pos_scaling_type": "linear",
    "pos_scaling_extra_args": None, "alibi_trainable_slopes": False, "share_embedding_weights": True,
    "embedding_layer_norm": False, "nonlinearity": "gelu", "norm_type": "layernorm", "layer_norm_epsilon": 1e-5,
    "attention_type": "scaled_dot_product", "attention_module": "aiayn_attention",
    "extra_attention_params": None, "attention_inner_dim": None, "attention_sliding_window_length": None,
    "attention_sink_tokens": None, "use_projection_bias_in_attention": True,
    "use_ffn_bias_in_attention": True, "use_ffn_bias": True, "use_bias_in_output": False,
    "dropout_rate": 0.1, "attention_dropout_rate": 0.1, "embedding_dropout_rate": None,
    "initializer_range": 0.02, "embedding_initializer": None, "initializer": None,
    "output_layer_initializer": None, "mup_base_hidden_size": None, "mup_base_filter_size": None,
    "embeddings_scale": 1.0, "output_logits_alpha": None, "scale_output_logits_by_d": True,
    "output_logits_scale": None, "scale_qk_dot_by_d": False, "attention_logits_alpha": 1.0,
    "use_untied_layer_norm": False, "scale_qk_dot_by_layer_idx": False, "attention_logit_softcapping": None,
    "final_logit_softcapping": None, "norm_first_sandwich": False, "sliding_window_every_other_decoder_layer": False,
}
# Every key a built model reads (ModelSpec.resolved(), models.config.ModelConfig's fields):
# ModelZoo's, the model class `name` selects, the MoE section and Sparse-Wide's level.
MODEL_KEYS: dict[str, Any] = {**MODELZOO_DEFAULTS, "model_class": "GPT2LMHeadModel", "moe": None,
                              "sparse_wide_sparsity": 0.0}
_SMALL_LLAMA = {"position_embedding_type": "rotary", "norm_type": "rmsnorm", "nonlinearity": "swiglu",
                "use_projection_bias_in_attention": False, "use_ffn_bias_in_attention": False,
                "use_ffn_bias": False, "share_embedding_weights": True, "dropout_rate": 0.0,
                "attention_dropout_rate": 0.0, "vocab_size": 256}
# filter_size ≈ 8/3 · hidden_size rounded to a multiple of 32, as in Llama.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {**_SMALL_LLAMA, "num_hidden_layers": 2, "num_heads": 4, "hidden_size": 64,
             "filter_size": 160, "max_position_embeddings": 128},
    "mini": {**_SMALL_LLAMA, "num_hidden_layers": 4, "num_heads": 4, "hidden_size": 128,
             "filter_size": 352, "max_position_embeddings": 256},
    "small": {**_SMALL_LLAMA, "num_hidden_layers": 8, "num_heads": 8, "hidden_size": 256,
              "filter_size": 672, "max_position_embeddings": 256},
}


class OptimizerSpec(_Section):
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


class RunConfigSpec(_Section):
    """The ``runconfig`` section: steps (``max_steps``, evaluation, checkpoint and logging
    cadences, all in optimizer steps), the seed, ``num_csx`` (1 to 192 systems) and where the
    run's model and MLflow experiment go."""

    SECTION = "runconfig"
    NOT_APPLIED = frozenset({
        "enable_distributed", "save_initial_checkpoint", "precision_opt_level", "use_cs_grad_accum",
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
    num_csx: PositiveInt = Field(1, le=192)  # a CS-2 cluster has at most 192 systems
    max_failures: NonNegativeInt = 3
    mlflow_experiment: str = "csx-sparse"
    model_dir: str | None = None
    checkpoint_path: str | None = None  # start (train) or evaluate (eval) from this checkpoint
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
