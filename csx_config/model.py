"""The ``model`` section: ModelZoo's decoder LM keys (GPT2LMHeadModel's and GPTJModel's, the class
chosen by ``model.name``), their ModelZoo defaults, our presets, and the keys a built model reads
(``MODEL_KEYS``: models.config.ModelConfig's fields). Our additions: ``model.preset`` (tiny /
mini / small: a small Llama filling the size keys the file does not give), ``model.tokenizer``
and ``model.sparse_wide_sparsity``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from csx_config.families import MODEL_CLASSES, model_name, not_built
from csx_config.keys import Section, validate_all_keys
from csx_config.schedulers import rename_aliases

PresetName = Literal["tiny", "mini", "small"]
# model.nonlinearity: the gated (GLU) ones and all of them.
GLU_NONLINEARITIES = ("swiglu", "geglu", "reglu")
NONLINEARITIES = ("gelu", "gelu_new", "relu", "silu", "swish", *GLU_NONLINEARITIES)
# model.moe.moe_implementation: ModelZoo's layouts of the experts' parameters (models/moe.py).
MOE_IMPLEMENTATIONS = ("optimized", "experimental", "functional", "forge_experimental", "expert_parallel")


class TokenizerSpec(Section):
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


class ExtraAttentionParams(Section):
    """``model.extra_attention_params``: ``num_kv_groups`` key/value heads for
    ``attention_module: multiquery_attention`` (1: multi-query; fewer than num_heads: GQA)."""
    SECTION = "model.extra_attention_params"
    num_kv_groups: PositiveInt | None = None


class MoESpec(Section):
    """``model.moe`` (``moe_params`` before 2.4): a mixture of ``num_experts`` FFN experts, each
    token routed to ``top_k`` of them by a learned router, plus ``num_shared_experts`` every
    token passes through; ``load_balancing_loss_coef`` weighs the router's balance loss;
    ``moe_implementation`` names the experts' parameters as that ModelZoo implementation does."""
    SECTION = "model.moe"
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
    # How ModelZoo lays the experts' parameters out (models/moe.py); None: the default of the
    # file's release, which csx_config.layouts fills in.
    moe_implementation: Literal[MOE_IMPLEMENTATIONS] | None = None

    @field_validator("gate_initializer")
    @classmethod
    def _initializer_named(cls, value: Initializer | None) -> Initializer | None:
        return check_initializer(value)

    @model_validator(mode="after")
    def _experts_cover_top_k(self) -> MoESpec:
        if self.top_k > self.num_experts:
            raise ValueError(f"model.moe.top_k ({self.top_k}) must be at most num_experts ({self.num_experts})")
        return self


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


class ModelSpec(Section):
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
        name = model_name(data)
        if name is not None and (not isinstance(name, str) or name not in MODEL_CLASSES):
            raise ValidationError.from_exception_data(cls.__name__, [InitErrorDetails(
                type=PydanticCustomError("not_supported", "{message}", {"message": not_built(name)}),
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
