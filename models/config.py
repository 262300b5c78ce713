"""The model's configuration: ModelZoo's model keys, checked together, and the widths and scales
derived from them (Sparse-Wide's widened config, muP's logit and attention factors). No torch:
the plan and the service read it too.

Sparse-Wide (Sparse-IFT, Thangarasa et al. 2023, arXiv:2303.11525): with
``sparse_wide_sparsity = s`` the widths inside the blocks grow by ``k = 1/sqrt(1 - s)``: the
residual stream (``hidden_size``, through a wider head with the same number of heads) and
``filter_size``. Every block projection then has ``k**2`` times the dense weights, so at
sparsity ``s`` its non-zeros and FLOPs per token equal the dense layer's. The embeddings, norms
and ``lm_head`` stay dense, but their width follows the residual stream (``training.report``
reports those costs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, make_dataclass, replace
from typing import Any

from csx_config.families import MODEL_CLASSES as CLASS_OF_NAME
from csx_config.model import GLU_NONLINEARITIES, MODEL_KEYS, NONLINEARITIES, PRESETS

# The classes built here: GPT2LMHeadModel (a sequential block) and GPTJModel (a parallel one).
MODEL_CLASSES = tuple(dict.fromkeys(CLASS_OF_NAME.values()))
ATTENTION_MODULES = ("aiayn_attention", "multiquery_attention")
POSITION_EMBEDDINGS = ("learned", "rotary", "alibi")
# The pos_scaling_extra_args each pos_scaling_type reads, with ModelZoo's defaults (None: required).
POS_SCALING_ARGS: dict[str, dict[str, Any]] = {
    "linear": {},
    "llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"original_max_position_embeddings": None, "beta_fast": 32.0, "beta_slow": 1.0,
             "extrapolation_factor": 1.0, "mscale_a": 0.1, "mscale_b": 1.0, "truncate": True},
}
EXTRA_ATTENTION_PARAMS = ("num_kv_groups",)
# Where each moe_implementation puts the experts' weights (models/moe.py has the layouts).
EXPERT_NAMES = {"optimized": "ffn.experts.fused_ffns.{i}.linear_layer.expert_weights",
                "experimental": "ffn.experts.experts.{e}.{i}, shared_experts.{s}.ffn.{i}",
                **dict.fromkeys(("functional", "forge_experimental", "expert_parallel"),
                                "ffn.experts.experts.{e}.ffn.{i}, shared ones last")}


# The fields: csx_config's model keys (MODEL_KEYS, typed and documented by
# csx_config.ModelSpec), defaulting to the tiny preset over ModelZoo's defaults.
_ModelKeys = make_dataclass("_ModelKeys", [(key, Any, field(default=value)) for key, value in
                                           {**MODEL_KEYS, **PRESETS["tiny"]}.items()], frozen=True)
_ModelKeys.__module__ = __name__


@dataclass(frozen=True)
class ModelConfig(_ModelKeys):
    """ModelZoo's model keys (``csx_config.MODEL_KEYS``; defaults: the tiny preset, a small
    Llama), checked together, with the widths and scales the model derives from them."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "filter_size",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.nonlinearity not in NONLINEARITIES:
            raise ValueError(f"model.nonlinearity {self.nonlinearity!r} is not one of {sorted(NONLINEARITIES)}")
        if not 0.0 <= self.sparse_wide_sparsity < 1.0:
            raise ValueError(
                f"model.sparse_wide_sparsity must be in [0, 1), got {self.sparse_wide_sparsity}")
        if self.model_class not in MODEL_CLASSES:
            raise ValueError(f"model class {self.model_class!r} is not one of {list(MODEL_CLASSES)}")
        if self.sliding_window_every_other_decoder_layer and self.attention_sliding_window_length is None:
            raise ValueError("model.sliding_window_every_other_decoder_layer needs model.attention_sliding_window_length")
        if self.norm_first_sandwich and self.is_parallel:
            raise ValueError("model.norm_first_sandwich is a key of the sequential block (GPT2LMHeadModel), "
                             "not of GPTJModel's parallel block")
        if self.moe is not None and not 1 <= self.moe.get("top_k", 1) <= self.moe.get("num_experts", 1):
            raise ValueError(f"model.moe.top_k must be in [1, num_experts], got {self.moe}")
        self._check_attention()
        self._check_positions()
        self._check_mup()

    def _check_attention(self) -> None:
        inner = "attention_inner_dim" if self.attention_inner_dim else "hidden_size"
        if self.inner_dim % self.num_heads:
            raise ValueError(f"model.{inner} ({self.inner_dim}) must be a multiple of num_heads ({self.num_heads})")
        if self.attention_module not in ATTENTION_MODULES:
            raise ValueError(f"model.attention_module {self.attention_module!r} is not one of "
                             f"{list(ATTENTION_MODULES)}")
        extra = self.extra_attention_params or {}
        for key in extra:
            if key not in EXTRA_ATTENTION_PARAMS:
                raise ValueError(f"model.extra_attention_params.{key} is not supported here "
                                 f"(known: {list(EXTRA_ATTENTION_PARAMS)})")
        if "num_kv_groups" in extra:
            groups = extra["num_kv_groups"]
            if self.attention_module != "multiquery_attention":
                raise ValueError("model.extra_attention_params.num_kv_groups needs "
                                 "model.attention_module: multiquery_attention")
            if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or self.num_heads % groups:
                raise ValueError(f"model.extra_attention_params.num_kv_groups ({groups!r}) must be a "
                                 f"positive divisor of num_heads ({self.num_heads})")
        window, sinks = self.attention_sliding_window_length, self.attention_sink_tokens
        if window is not None and window < 1:
            raise ValueError(f"model.attention_sliding_window_length must be >= 1, got {window}")
        if sinks is not None and (window is None or sinks < 0):
            raise ValueError("model.attention_sink_tokens needs model.attention_sliding_window_length "
                             f"and must be >= 0, got {sinks}")

    def _check_positions(self) -> None:
        kind, scaling = self.position_embedding_type, self.pos_scaling_type.lower()
        if kind not in POSITION_EMBEDDINGS:
            raise ValueError(f"model.position_embedding_type {kind!r} is not one of {list(POSITION_EMBEDDINGS)}")
        if kind == "rotary" and (self.rotary_size % 2 or self.rotary_size > self.head_dim):
            raise ValueError(f"model.rotary_dim ({self.rotary_size}) must be even and at most the "
                             f"head size {self.head_dim}")
        if scaling not in POS_SCALING_ARGS:
            raise ValueError(f"model.pos_scaling_type {self.pos_scaling_type!r} is not one of {list(POS_SCALING_ARGS)}")
        if not self.pos_scaling_factor > 0:
            raise ValueError(f"model.pos_scaling_factor must be > 0, got {self.pos_scaling_factor}")
        if kind == "learned" and (self.pos_scaling_factor != 1.0 or scaling != "linear"):
            raise ValueError("model.pos_scaling_factor / pos_scaling_type apply to rotary and alibi "
                             "positions only, not learned ones")
        if kind == "alibi" and scaling != "linear":
            raise ValueError("model.pos_scaling_type must be linear with alibi positions")
        for key in self.pos_scaling_extra_args or {}:
            if key not in POS_SCALING_ARGS[scaling]:
                raise ValueError(f"model.pos_scaling_extra_args.{key} is not read by pos_scaling_type "
                                 f"{scaling} (it reads {list(POS_SCALING_ARGS[scaling])})")
        missing = [key for key, value in self.scaling_args.items() if value is None]
        if missing:
            raise ValueError(f"model.pos_scaling_extra_args needs {missing} for pos_scaling_type {scaling}")

    def _check_mup(self) -> None:
        bases = (self.mup_base_hidden_size, self.mup_base_filter_size)
        if (bases[0] is None) != (bases[1] is None):
            raise ValueError("muP needs both model.mup_base_hidden_size and model.mup_base_filter_size")
        if bases[0] is not None and self.output_logits_scale is not None:
            raise ValueError("model.output_logits_scale is the older muP form: give it, or the muP base "
                             "sizes (mup_base_hidden_size, mup_base_filter_size), not both")

    @property
    def is_parallel(self) -> bool:
        return self.model_class == "GPTJModel"

    @property
    def experts(self) -> int:
        """Routed experts of each MoE block (0: a plain FFN, as ModelZoo builds num_experts 1)."""
        moe = self.moe or {}
        total = moe.get("num_experts", 1) + (moe.get("num_shared_experts") or 0)
        return moe.get("num_experts", 1) if total > 1 else 0

    def features(self) -> list[str]:
        """What this config builds beyond the sizes, positions, norm and nonlinearity, each in
        a few words (the plan's model line lists them all)."""
        c, moe, window = self, self.moe or {}, self.attention_sliding_window_length
        named = [
            (c.is_parallel, lambda: "parallel attention and FFN" + (", untied norms" if c.use_untied_layer_norm else "")),
            (window, lambda: f"sliding window {window}" + (" on every other layer"
                                                           if c.sliding_window_every_other_decoder_layer else "")),
            (c.attention_sink_tokens, lambda: f"{c.attention_sink_tokens} attention sink tokens"),
            (c.attention_logit_softcapping, lambda: f"attention logit soft-capping {c.attention_logit_softcapping:g}"),
            (c.final_logit_softcapping, lambda: f"final logit soft-capping {c.final_logit_softcapping:g}"),
            (c.norm_first_sandwich, lambda: "sandwich norms"),
            (c.embedding_layer_norm, lambda: "embedding layer norm"),
            (c.attention_type == "dot_product", lambda: "unscaled dot-product attention"),
            (c.scale_qk_dot_by_layer_idx, lambda: "QK scaled by 1/(layer + 1)"),
            (c.attention_inner_dim, lambda: f"attention width {c.attention_inner_dim}"),
            (c.position_embedding_type == "rotary" and c.rotary_size != c.head_dim,
             lambda: f"rotary on {c.rotary_size} of {c.head_dim} head dims"),
            (c.alibi_trainable_slopes and c.position_embedding_type == "alibi", lambda: "trainable ALiBi slopes"),
            (not c.share_embedding_weights, lambda: "untied lm_head"),
            (c.mup_base_hidden_size or c.output_logits_scale, lambda: "muP"),
            (c.sparse_wide_sparsity, lambda: f"Sparse-Wide s={c.sparse_wide_sparsity}"),
            (c.experts, lambda: f"{moe.get('num_experts', 1)} experts, top {moe.get('top_k', 1)}"
                                + (f" + {moe['num_shared_experts']} shared" if moe.get("num_shared_experts") else "")),
            (c.experts, lambda: f"{c.moe_implementation} expert layout ({EXPERT_NAMES[c.moe_implementation]})"),
        ]
        return [text() for given, text in named if given]

    @property
    def moe_implementation(self) -> str:
        """ModelZoo's implementation whose parameter names the experts take (models/moe.py);
        unset: the current release's default."""
        return (self.moe or {}).get("moe_implementation") or "experimental"

    def window_of_layer(self, index: int) -> int | None:
        """The sliding window of decoder layer ``index``: every layer's, or with
        sliding_window_every_other_decoder_layer the odd layers' only (ModelZoo's order)."""
        if self.sliding_window_every_other_decoder_layer and index % 2 == 0:
            return None
        return self.attention_sliding_window_length

    @property
    def inner_dim(self) -> int:
        """Width of all query (and output-projection input) heads together."""
        return self.attention_inner_dim or self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.inner_dim // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_heads, or num_kv_groups for multiquery_attention (default 1)."""
        if self.attention_module != "multiquery_attention":
            return self.num_heads
        return (self.extra_attention_params or {}).get("num_kv_groups", 1)

    @property
    def rotary_size(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def scaling_args(self) -> dict[str, Any]:
        """pos_scaling_extra_args with ModelZoo's defaults for the scaling type."""
        return {**POS_SCALING_ARGS[self.pos_scaling_type.lower()], **(self.pos_scaling_extra_args or {})}

    @property
    def is_glu(self) -> bool:
        return self.nonlinearity in GLU_NONLINEARITIES

    @property
    def attention_scale(self) -> float:
        """The factor on QKᵀ: 1/sqrt(d) (scaled_dot_product), 1/d with muP's scale_qk_dot_by_d,
        1 (dot_product), each times attention_logits_alpha; d is the head size."""
        scale = 1.0
        if self.attention_type == "scaled_dot_product":
            scale = 1.0 / self.head_dim if self.scale_qk_dot_by_d else self.head_dim ** -0.5
        return self.attention_logits_alpha * scale

    @property
    def logits_scale(self) -> float:
        """The factor on the output logits (muP), 1.0 without muP."""
        if self.mup_base_hidden_size:
            width = self.hidden_size / self.mup_base_hidden_size
            alpha = self.output_logits_alpha or 1.0
            return alpha / width if self.scale_output_logits_by_d else alpha / math.sqrt(width)
        return self.output_logits_scale or 1.0

    def widened(self) -> ModelConfig:
        """The config actually built: Sparse-Wide widths applied (identity when s = 0)."""
        if self.sparse_wide_sparsity == 0.0:
            return self
        k = 1.0 / math.sqrt(1.0 - self.sparse_wide_sparsity)
        head_dim = 2 * max(1, round(self.head_dim * k / 2))  # rotary needs an even head size
        rotary = None if self.rotary_dim is None else min(head_dim, 2 * round(self.rotary_dim * k / 2))
        hidden, inner = head_dim * self.num_heads, None
        if self.attention_inner_dim is not None:  # heads narrower than the stream stay so
            hidden, inner = max(1, round(self.hidden_size * k)), head_dim * self.num_heads
        return replace(self, hidden_size=hidden, attention_inner_dim=inner, rotary_dim=rotary,
                       filter_size=max(1, round(self.filter_size * k)), sparse_wide_sparsity=0.0)


def preset_config(name: str, **overrides: Any) -> ModelConfig:
    """A ``model.preset`` (csx_config.PRESETS) as a config, with keys replaced."""
    if name not in PRESETS:
        raise ValueError(f"model.preset {name!r} is unknown; choose one of {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})
