"""One pre-norm decoder for the GPT-2/3, Cerebras-GPT, BTLM, Llama 1-3 and Mistral families,
with ModelZoo's parameter names.

GPT-2/3: learned positions, LayerNorm, GELU, biases. Llama: rotary positions, RMSNorm, SwiGLU,
no biases. Everything is picked by ModelZoo's model keys (``ModelConfig`` mirrors them):

- grouped-query / multi-query attention: ``attention_module: multiquery_attention`` with
  ``extra_attention_params: {num_kv_groups: G}`` (G key/value heads; ModelZoo's default 1 is
  MQA), query head h reading key/value head ``h // (num_heads / G)``; ``attention_inner_dim``
  (Mistral-Nemo: q/k/v heads narrower than the residual stream);
- rotary positions with ``rope_theta``, ``rotary_dim`` and ``pos_scaling_type`` linear (positions
  divided by ``pos_scaling_factor``), llama3 (Llama-3.1's banded rule) or yarn, their
  ``pos_scaling_extra_args`` as ModelZoo names them; ALiBi (``position_embedding_type: alibi``,
  Press et al. 2022, optionally ``alibi_trainable_slopes``);
- sliding-window attention (``attention_sliding_window_length``: each query sees itself and
  the window - 1 tokens before it; ``attention_sink_tokens``: the first tokens stay visible);
- muP (Cerebras-GPT, BTLM): ``embeddings_scale``, ``scale_qk_dot_by_d``,
  ``attention_logits_alpha``, and the output logits scaled by ``output_logits_alpha`` times
  ``mup_base_hidden_size / hidden_size`` (its square root unless ``scale_output_logits_by_d``),
  or by a given ``output_logits_scale`` (the 1.x form); with the base sizes, the initializers
  are scaled by width and depth as ModelZoo scales them, and ``lr_adjustment_scales`` gives the
  per-layer learning-rate factors (``training.build.make_optimizer`` applies them).

Parameters are named as ModelZoo's ``GPT2LMHeadModel`` names them, so a ModelZoo
``param_filter`` / ``param_name_patterns`` selects exactly the layers it selects there::

    embedding_layer.word_embeddings.weight, embedding_layer.position_embeddings.weight
    embedding_layer.position_embed_helper.slopes                   (trainable ALiBi slopes)
    embedding_ln_f.{weight,bias}                                   (embedding_layer_norm)
    transformer_decoder.layers.{i}.norm1.{weight,bias}
    transformer_decoder.layers.{i}.self_attn.proj_{q,k,v}_dense_layer.{weight,bias}
    transformer_decoder.layers.{i}.self_attn.proj_output_dense_layer.{weight,bias}
    transformer_decoder.layers.{i}.norm3.{weight,bias}
    transformer_decoder.layers.{i}.ffn.ffn.0.linear_layer.{weight,bias}
    transformer_decoder.layers.{i}.ffn.ffn.0.linear_layer_for_glu.{weight,bias}   (GLU only)
    transformer_decoder.layers.{i}.ffn.ffn.1.linear_layer.{weight,bias}
    transformer_decoder.norm.{weight,bias}, lm_head.weight (absent when tied to the embedding)

The default sparsity filter (matrices whose name has no "embedding" / "norm" / "lm_head")
therefore picks exactly the attention and FFN projections of every block.

Sparse-Wide (Sparse-IFT, Thangarasa et al. 2023, arXiv:2303.11525): with
``sparse_wide_sparsity = s`` the widths inside the blocks grow by ``k = 1/sqrt(1 - s)``: the
residual stream (``hidden_size``, through a wider head with the same number of heads) and
``filter_size``. Every block projection then has ``k**2`` times the dense weights, so at
sparsity ``s`` its non-zeros and FLOPs per token equal the dense layer's. The embeddings, norms
and ``lm_head`` stay dense, but their width follows the residual stream (``training.report``
reports those costs).
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MODEL_CLASSES = ("GPT2LMHeadModel", "GPTJModel")
ROUTED_EXPERT = re.compile(r"transformer_decoder\.layers\.(\d+)\.ffn\.experts\.experts\.(\d+)\.")
GLU_ACTIVATIONS = {"swiglu": F.silu, "geglu": F.gelu, "reglu": F.relu}
ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
               "silu": F.silu, "swish": F.silu}
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


@dataclass(frozen=True)
class ModelConfig:
    """ModelZoo's model keys (defaults: a tiny Llama) plus ``sparse_wide_sparsity``."""
    vocab_size: int = 256
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_heads: int = 4
    filter_size: int = 160
    max_position_embeddings: int = 128
    position_embedding_type: str = "rotary"
    rotary_dim: int | None = None  # None: the whole head
    rope_theta: float = 10000.0
    pos_scaling_factor: float = 1.0
    pos_scaling_type: str = "linear"
    pos_scaling_extra_args: dict[str, Any] | None = None
    alibi_trainable_slopes: bool = False
    share_embedding_weights: bool = True
    embedding_layer_norm: bool = False
    nonlinearity: str = "swiglu"
    norm_type: str = "rmsnorm"
    layer_norm_epsilon: float = 1e-5
    attention_type: str = "scaled_dot_product"
    attention_module: str = "aiayn_attention"
    extra_attention_params: dict[str, Any] | None = None
    attention_inner_dim: int | None = None  # None: hidden_size
    attention_sliding_window_length: int | None = None
    attention_sink_tokens: int | None = None
    use_projection_bias_in_attention: bool = False
    use_ffn_bias_in_attention: bool = False
    use_ffn_bias: bool = False
    use_bias_in_output: bool = False
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    embedding_dropout_rate: float | None = None  # None: dropout_rate
    initializer_range: float = 0.02
    embedding_initializer: dict[str, Any] | None = None
    initializer: dict[str, Any] | None = None
    output_layer_initializer: dict[str, Any] | None = None
    # muP
    mup_base_hidden_size: float | None = None
    mup_base_filter_size: float | None = None
    embeddings_scale: float = 1.0
    output_logits_alpha: float | None = None
    scale_output_logits_by_d: bool = True
    output_logits_scale: float | None = None
    scale_qk_dot_by_d: bool = False
    attention_logits_alpha: float = 1.0
    # ModelZoo's model class: GPT2LMHeadModel (sequential block) or GPTJModel (parallel block)
    model_class: str = "GPT2LMHeadModel"
    use_untied_layer_norm: bool = False  # GPTJModel: norm3 before the FFN (NeoX), else norm1 for both
    scale_qk_dot_by_layer_idx: bool = False  # QKᵀ of layer i (from 0) also divided by i + 1
    attention_logit_softcapping: float | None = None  # Gemma-2: c·tanh(logits / c)
    final_logit_softcapping: float | None = None
    norm_first_sandwich: bool = False  # Gemma-2: norm1_post / norm3_post on each sublayer's output
    sliding_window_every_other_decoder_layer: bool = False  # the window on odd layers only
    moe: dict[str, Any] | None = None  # model.moe (csx_config.sections.MoESpec's keys)
    sparse_wide_sparsity: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "filter_size",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.nonlinearity not in GLU_ACTIVATIONS and self.nonlinearity not in ACTIVATIONS:
            raise ValueError(f"model.nonlinearity {self.nonlinearity!r} is not one of "
                             f"{sorted({**GLU_ACTIVATIONS, **ACTIVATIONS})}")
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
        return self.nonlinearity in GLU_ACTIVATIONS

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


# ModelZoo's lr_adjustment_groups, in its order: parameter globs of each named group.
LR_ADJUSTMENT_GROUPS = {
    "embedding": ("*embedding*weight",),
    "decoder_kernel": ("*decoder*dense*weight", "*decoder*linear*weight"),  # the 1.x muP group
    "decoder_attention": ("*decoder*attn*dense*weight",),
    "decoder_input_ffn": ("*decoder*ffn.ffn.[!1]*weight",),
    "decoder_output_ffn": ("*decoder*ffn.ffn.[1]*weight",),
}


def lr_adjustment_scales(config: ModelConfig, adjust: dict[str, float] | None = None) -> dict[str, float]:
    """The learning-rate factor of each group: with muP's base sizes 1 / the width multiplier
    for the attention and FFN input kernels (hidden / mup_base_hidden_size) and the FFN output
    kernels (filter / mup_base_filter_size); ``adjust`` (``optimizer.adjust_learning_rate``,
    the 1.x muP files' ``{decoder_kernel: 1/3}``) sets groups by name."""
    scales = dict.fromkeys(LR_ADJUSTMENT_GROUPS, 1.0)
    if config.mup_base_hidden_size and config.mup_base_filter_size:
        scales["decoder_attention"] = scales["decoder_input_ffn"] = config.mup_base_hidden_size / config.hidden_size
        scales["decoder_output_ffn"] = config.mup_base_filter_size / config.filter_size
    for group, scale in (adjust or {}).items():
        if group not in scales:
            raise ValueError(f"optimizer.adjust_learning_rate.{group} is not one of {list(LR_ADJUSTMENT_GROUPS)}")
        scales[group] = scale
    return scales


def learning_rate_scale(scales: dict[str, float], name: str) -> float:
    """The factor of parameter ``name``: its first group (in ModelZoo's order) with a factor."""
    for group, globs in LR_ADJUSTMENT_GROUPS.items():
        if scales[group] != 1.0 and any(fnmatch.fnmatchcase(name, glob) for glob in globs):
            return scales[group]
    return 1.0


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon,
                        bias=config.norm_type != "biasless-layernorm")  # MPT: no bias


def rope_frequencies(rotary_dim: int, theta: float, scaling_type: str = "linear", factor: float = 1.0,
                     scaling_args: dict[str, Any] | None = None, device: Any = None) -> tuple[torch.Tensor, float]:
    """The inverse frequency of each rotated channel pair, and the factor on cos and sin (YaRN's
    attention temperature). Linear scaling divides the positions instead (``rope_tables``)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
    scaling_type = scaling_type.lower()
    args = {**POS_SCALING_ARGS[scaling_type], **(scaling_args or {})}
    if scaling_type == "llama3":
        return _llama3_frequencies(inv_freq, factor, **args), 1.0
    if scaling_type == "yarn":
        return _yarn_frequencies(inv_freq, rotary_dim, theta, factor, **args)
    return inv_freq, 1.0


def _llama3_frequencies(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> torch.Tensor:
    """Llama-3.1: wavelengths shorter than original / high_freq_factor are kept, longer than
    original / low_freq_factor are divided by the factor, and those between are blended."""
    wavelength = 2 * math.pi / inv_freq
    smooth = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelength < original_max_position_embeddings / high_freq_factor, inv_freq,
                       torch.where(wavelength > original_max_position_embeddings / low_freq_factor,
                                   inv_freq / factor, blended))


def _yarn_frequencies(inv_freq: torch.Tensor, rotary_dim: int, theta: float, factor: float, *,
                      original_max_position_embeddings: int, beta_fast: float, beta_slow: float,
                      extrapolation_factor: float, mscale_a: float, mscale_b: float,
                      truncate: bool) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, arXiv:2309.00071): pairs that turn more than beta_fast times over
    the original context keep their frequency, fewer than beta_slow are interpolated (divided by
    the factor), a linear ramp between; the logits get the temperature a·ln(factor) + b."""
    def pair_index(rotations: float) -> float:
        turns = original_max_position_embeddings / (rotations * 2 * math.pi)
        return rotary_dim * math.log(turns) / (2 * math.log(theta))

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    pairs = torch.arange(rotary_dim // 2, dtype=torch.float32, device=inv_freq.device)
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)
    kept = (1 - ramp) * extrapolation_factor
    mscale = mscale_a * math.log(factor) + mscale_b if factor > 1 else 1.0
    return inv_freq / factor * (1 - kept) + inv_freq * kept, mscale


def rope_tables(rotary_dim: int, length: int, theta: float, device: Any = None, *, scaling_type: str = "linear",
                factor: float = 1.0, scaling_args: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (length, rotary_dim // 2) for rotating channel pairs; linear
    scaling (position interpolation, Chen et al. 2023) divides the positions by ``factor``."""
    inv_freq, mscale = rope_frequencies(rotary_dim, theta, scaling_type, factor, scaling_args, device)
    positions = torch.arange(length, dtype=torch.float32, device=device)
    if scaling_type.lower() == "linear":
        positions = positions / factor
    angles = torch.outer(positions, inv_freq)
    return angles.cos() * mscale, angles.sin() * mscale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (even, odd) channel pairs of the first ``2 * cos.shape[-1]`` channels of x
    (B, H, T, D) by position-dependent angles; the other channels pass through."""
    seq, rotated_dims = x.shape[-2], 2 * cos.shape[-1]
    cos, sin = cos[:seq], sin[:seq]
    part, rest = x[..., :rotated_dims], x[..., rotated_dims:]
    even, odd = part[..., 0::2], part[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def alibi_slopes(num_heads: int) -> list[float]:
    """Press et al. 2022: for 2^k heads the geometric sequence 2^(-8/n), 2^(-16/n), ...; for
    other counts that sequence for the largest power of two below, then every other slope of
    the sequence for twice that power."""
    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    power = 2 ** math.floor(math.log2(num_heads))
    return geometric(power) + geometric(2 * power)[0::2][:num_heads - power]


class AlibiPositions(nn.Module):
    """ModelZoo's ALiBi ``position_embed_helper``: adds ``-slope_h · |i - j| / pos_scaling_factor``
    to the attention logits of query i and key j in head h. Fixed slopes are a buffer (not a
    parameter); trainable ones start from ModelZoo's xavier_uniform draw."""

    def __init__(self, num_heads: int, trainable: bool, scaling_factor: float) -> None:
        super().__init__()
        if trainable:
            self.slopes = nn.Parameter(torch.empty(num_heads, 1))
        else:
            self.register_buffer("slopes", torch.tensor(alibi_slopes(num_heads)).unsqueeze(-1), persistent=False)
        self.scaling_factor = scaling_factor

    def forward(self, length: int, device: Any) -> torch.Tensor:
        positions = torch.arange(length, dtype=torch.float32, device=device)
        distance = (positions[:, None] - positions[None, :]).abs()
        return -(self.slopes[:, :, None] / self.scaling_factor) * distance  # (heads, T, T)


def visible_keys(length: int, window: int | None, sink_tokens: int | None, device: Any = None) -> torch.Tensor:
    """(T, T) bool, True where query i sees key j: j <= i and, with a sliding window, i - j <
    window (itself and window - 1 before it) or j among the first sink_tokens."""
    positions = torch.arange(length, device=device)
    query, key = positions[:, None], positions[None, :]
    visible = key <= query
    if window is not None:
        visible &= (query - key < window) | (key < (sink_tokens or 0))
    return visible


class MultiheadAttention(nn.Module):
    """ModelZoo's attention (aiayn_attention) and, with fewer key/value heads,
    multiquery_attention: k and v project to num_kv_groups heads, each shared by
    num_heads / num_kv_groups consecutive query heads."""

    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__()
        width, bias = config.hidden_size, config.use_projection_bias_in_attention
        self.num_heads, self.kv_heads, self.head_dim = config.num_heads, config.kv_heads, config.head_dim
        self.proj_q_dense_layer = nn.Linear(width, config.inner_dim, bias=bias)
        self.proj_k_dense_layer = nn.Linear(width, self.kv_heads * self.head_dim, bias=bias)
        self.proj_v_dense_layer = nn.Linear(width, self.kv_heads * self.head_dim, bias=bias)
        self.proj_output_dense_layer = nn.Linear(config.inner_dim, width, bias=config.use_ffn_bias_in_attention)
        self.dropout = config.attention_dropout_rate
        self.scale = config.attention_scale / (layer_index + 1 if config.scale_qk_dot_by_layer_idx else 1)
        self.softcap = config.attention_logit_softcapping
        # Read by simulator.layers_from_model to cost the attention scores.
        self.window, self.sink_tokens = config.window_of_layer(layer_index), config.attention_sink_tokens

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        """``mask``: None (causal), bool (T, T) visible keys, or a float additive bias (H, T, T)."""
        def heads(t: torch.Tensor, count: int) -> torch.Tensor:
            return t.unflatten(-1, (count, self.head_dim)).transpose(1, 2)

        q = heads(self.proj_q_dense_layer(x), self.num_heads)
        k = heads(self.proj_k_dense_layer(x), self.kv_heads)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if mask is not None and mask.is_floating_point():
            mask = mask.to(q.dtype)  # under autocast
        v, dropout = heads(self.proj_v_dense_layer(x), self.kv_heads), self.dropout if self.training else 0.0
        if self.softcap is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout,
                                               scale=self.scale, enable_gqa=self.kv_heads != self.num_heads)
        else:
            y = self._softcapped(q, k, v, mask, dropout)
        return self.proj_output_dense_layer(y.transpose(1, 2).flatten(2))

    def _softcapped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    dropout: float) -> torch.Tensor:
        """Attention with Gemma-2's logit soft-capping (cap · tanh(logits / cap), before the mask),
        which SDPA cannot apply."""
        repeat = self.num_heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        logits = (q @ k.transpose(-1, -2)) * self.scale
        logits = self.softcap * torch.tanh(logits / self.softcap)
        length = q.shape[-2]
        if mask is None:
            mask = visible_keys(length, None, None, q.device)
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
        return F.dropout(logits.softmax(-1), dropout) @ v


class FeedForwardLayer(nn.Module):
    """ModelZoo's SingleFeedForwardLayer: act(linear_layer(x)), times linear_layer_for_glu(x)
    for a GLU nonlinearity."""

    def __init__(self, in_features: int, out_features: int, bias: bool, activation: str | None) -> None:
        super().__init__()
        self.linear_layer = nn.Linear(in_features, out_features, bias=bias)
        self.activation = activation
        if activation in GLU_ACTIVATIONS:
            self.linear_layer_for_glu = nn.Linear(in_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_layer(x)
        if self.activation in GLU_ACTIVATIONS:
            return GLU_ACTIVATIONS[self.activation](y) * self.linear_layer_for_glu(x)
        return ACTIVATIONS[self.activation](y) if self.activation else y


class FeedForwardNetwork(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ffn = nn.ModuleList([
            FeedForwardLayer(config.hidden_size, config.filter_size, config.use_ffn_bias, config.nonlinearity),
            FeedForwardLayer(config.filter_size, config.hidden_size, config.use_ffn_bias, None)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn[1](self.ffn[0](x))


class ExpertsFeedForwardNetwork(nn.Module):
    """ModelZoo's functional experts: ``experts.{e}`` is a whole FFN (routed experts first, then
    the shared ones), so a sparsity filter on ``*linear_layer.weight`` gives every expert its own
    masks."""

    def __init__(self, config: ModelConfig, count: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(FeedForwardNetwork(config) for _ in range(count))


class SparseMoEBlock(nn.Module):
    """A mixture of experts in place of the FFN (Mixtral; Shazeer et al. 2017): a learned router
    (``gate``, kept dense) sends each token to its ``top_k`` experts by softmax probability and
    sums their outputs weighted by those probabilities (renormalised over the chosen k, plus
    ``null_expert_bias`` when given); shared experts see every token with weight 1. Each forward
    keeps the router probabilities and the 0/1 choice of every token (``routing``) for the
    load-balancing loss and the router-load metrics."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe or {}
        self.num_experts, self.top_k = moe.get("num_experts", 1), moe.get("top_k", 1)
        self.router_fp32 = moe.get("router_fp32", True)
        self.normalize = moe.get("expert_weighting_normalization", True)
        self.null_expert_bias = moe.get("null_expert_bias") or 0.0
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.gate.weight.requires_dense = True  # the router stays dense under any sparsity filter
        self.experts = ExpertsFeedForwardNetwork(config, self.num_experts + (moe.get("num_shared_experts") or 0))
        self.routing: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.router_fp32:  # in float32 even under autocast, which would run the gate in 16 bits
            with torch.autocast(x.device.type, enabled=False):
                logits = F.linear(x.float(), self.gate.weight.float())
        else:
            logits = self.gate(x)
        probs = logits.softmax(-1)
        top_probs, top_index = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            top_probs = top_probs / (top_probs.sum(-1, keepdim=True) + self.null_expert_bias)
        chosen = F.one_hot(top_index, self.num_experts).to(probs.dtype)  # (B, T, k, E)
        weights = (top_probs.unsqueeze(-1) * chosen).sum(-2).to(x.dtype)  # (B, T, E), 0 where not chosen
        self.routing = (probs, chosen.sum(-2))
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts.experts):
            weight = weights[..., index, None] if index < self.num_experts else 1.0
            out = out + weight * expert(x)
        return out


def load_balancing_loss(routings: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """ModelZoo's LoadBalancingLoss (Switch Transformer's, Fedus et al. 2021, for top-k): per
    sequence, the share of tokens sent to each expert and its mean router probability, each
    averaged over the MoE layers; E² times the mean of their product (1 when perfectly even
    with k = 1)."""
    experts = routings[0][0].shape[-1]
    tokens = torch.stack([chosen.mean(1) for _, chosen in routings]).mean(0)  # (B, E)
    probs = torch.stack([probs.mean(1) for probs, _ in routings]).mean(0)
    return experts ** 2 * (tokens * probs).mean()


class DecoderLayer(nn.Module):
    """Pre-norm. GPT2LMHeadModel: x + attn(norm1(x)), then x + ffn(norm3(x)) (norm2 is
    ModelZoo's cross-attention), with ``norm_first_sandwich`` each sublayer's output normed
    again (norm1_post, norm3_post). GPTJModel (GPT-J, NeoX, Falcon): one parallel step,
    x + attn(norm1(x)) + ffn(norm3(x)), norm3 only with ``use_untied_layer_norm`` (else
    norm1 feeds both). The FFN is a mixture of experts when ``moe`` has several."""

    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.parallel = config.is_parallel
        self.norm1 = make_norm(config)
        self.self_attn = MultiheadAttention(config, index)
        if config.norm_first_sandwich:
            self.norm1_post = make_norm(config)
        if not self.parallel or config.use_untied_layer_norm:
            self.norm3 = make_norm(config)
        self.ffn = SparseMoEBlock(config) if config.experts else FeedForwardNetwork(config)
        if config.norm_first_sandwich:
            self.norm3_post = make_norm(config)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        normed = self.norm1(x)
        attended = self.self_attn(normed, rope, mask)
        if self.parallel:
            ffn_input = self.norm3(x) if hasattr(self, "norm3") else normed
            return x + self.dropout(attended) + self.dropout(self.ffn(ffn_input))
        if hasattr(self, "norm1_post"):
            attended = self.norm1_post(attended)
        x = x + self.dropout(attended)
        out = self.ffn(self.norm3(x))
        if hasattr(self, "norm3_post"):
            out = self.norm3_post(out)
        return x + self.dropout(out)


class TransformerDecoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(config, index) for index in range(config.num_hidden_layers))
        self.norm = make_norm(config)


class EmbeddingLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding_type == "learned":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        elif config.position_embedding_type == "alibi":
            self.position_embed_helper = AlibiPositions(config.num_heads, config.alibi_trainable_slopes,
                                                        config.pos_scaling_factor)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)
        if hasattr(self, "position_embeddings"):
            x = x + self.position_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        return x


# std of a unit normal cut at two standard deviations, to undo for variance_scaling's truncated draw
TRUNCATED_NORMAL_STD = 0.87962566103423978


def variance_scaling_(tensor: torch.Tensor, scale: float = 1.0, mode: str = "fan_in",
                      distribution: str = "truncated_normal") -> torch.Tensor:
    """ModelZoo's variance_scaling (the TensorFlow initializer): variance scale / n, n the fan
    in, fan out or their mean; drawn from a truncated normal (cut at 2 std, the std corrected so
    the variance is kept), a normal, or a uniform distribution."""
    fan_in, fan_out = nn.init._calculate_fan_in_and_fan_out(tensor)
    fans = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}
    if mode not in fans:
        raise ValueError(f"variance_scaling mode {mode!r} is not one of {list(fans)}")
    variance = scale / max(1.0, fans[mode])
    if distribution == "truncated_normal":
        std = math.sqrt(variance) / TRUNCATED_NORMAL_STD
        return nn.init.trunc_normal_(tensor, std=std, a=-2 * std, b=2 * std)
    if distribution in ("normal", "untruncated_normal"):
        return nn.init.normal_(tensor, std=math.sqrt(variance))
    if distribution == "uniform":
        limit = math.sqrt(3 * variance)
        return nn.init.uniform_(tensor, -limit, limit)
    raise ValueError(f"variance_scaling distribution {distribution!r} is not one of "
                     "['truncated_normal', 'normal', 'untruncated_normal', 'uniform']")


INIT_FUNCTIONS = {"normal": nn.init.normal_, "truncated_normal": nn.init.trunc_normal_,
                  "uniform": nn.init.uniform_, "xavier_uniform": nn.init.xavier_uniform_,
                  "xavier_normal": nn.init.xavier_normal_, "zeros": nn.init.zeros_, "ones": nn.init.ones_,
                  "variance_scaling": variance_scaling_}
Initializer = dict[str, Any]


def default_initializer(std: float) -> Initializer:
    """ModelZoo's default: a truncated normal of ``std`` cut at two standard deviations."""
    return {"name": "truncated_normal", "mean": 0.0, "std": std, "a": -2 * std, "b": 2 * std}


def scaled_initializer(spec: Initializer, factor: float) -> Initializer:
    """``spec`` with its spread times ``factor`` (muP and depth scaling); like ModelZoo, only
    normal and truncated normal initializers are scaled."""
    if spec["name"] == "normal":
        return {**spec, "std": spec.get("std", 1.0) * factor}
    if spec["name"] == "truncated_normal":
        return {**spec, **{k: spec[k] * factor for k in ("std", "a", "b") if k in spec}}
    return spec


def initializers(c: ModelConfig) -> dict[str, Initializer]:
    """The initializer of each role (embedding, block input projections, FFN input, attention
    output, FFN output, MoE router), as ModelZoo chooses them: residual-stream outputs default to
    std / sqrt(2L), and muP scales the block initializers by the width multipliers
    (hidden / base)^-1/2, the outputs also by (2L)^-1/2. GPTJModel has no depth scaling and
    draws the FFN input from the output layer's initializer."""
    default = default_initializer(c.initializer_range)
    gate = (c.moe or {}).get("gate_initializer") or default
    if c.is_parallel:
        output = c.output_layer_initializer or default
        block, ffn_input, ffn_output = c.initializer or default, output, output
        if c.mup_base_hidden_size:
            width = (c.hidden_size / c.mup_base_hidden_size) ** -0.5
            depth = (2 * c.num_hidden_layers) ** -0.5
            block, ffn_input = scaled_initializer(block, width), scaled_initializer(ffn_input, width)
            output = ffn_output = scaled_initializer(output, width * depth)
        if c.mup_base_filter_size:
            ffn_output = scaled_initializer(c.output_layer_initializer or default,
                                            (c.filter_size / c.mup_base_filter_size) ** -0.5
                                            * (2 * c.num_hidden_layers) ** -0.5)
        return {"embedding": c.embedding_initializer or default, "block": block, "ffn_input": ffn_input,
                "output": output, "ffn_output": ffn_output, "gate": gate}
    depth = (2 * c.num_hidden_layers) ** -0.5
    block = c.initializer or default
    output = c.output_layer_initializer or (block if c.initializer else scaled_initializer(default, depth))
    ffn_output = output
    if c.mup_base_hidden_size:
        width = (c.hidden_size / c.mup_base_hidden_size) ** -0.5
        block = scaled_initializer(block, width)
        output = scaled_initializer(c.output_layer_initializer or default, width * depth)
        ffn_output = output
    if c.mup_base_filter_size:
        ffn_output = scaled_initializer(default, (c.filter_size / c.mup_base_filter_size) ** -0.5 * depth)
    return {"embedding": c.embedding_initializer or default, "block": block, "ffn_input": block,
            "output": output, "ffn_output": ffn_output, "gate": gate}


def _initialize(param: torch.Tensor, spec: Initializer) -> None:
    INIT_FUNCTIONS[spec["name"]](param, **{k: v for k, v in spec.items() if k != "name"})


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config  # as requested; `built` holds the Sparse-Wide widths
        built = config.widened()
        self.built = built
        self.embedding_layer = EmbeddingLayer(built)
        if built.embedding_layer_norm:
            self.embedding_ln_f = make_norm(built)
        self.drop_embd = nn.Dropout(built.dropout_rate if built.embedding_dropout_rate is None
                                    else built.embedding_dropout_rate)
        self.transformer_decoder = TransformerDecoder(built)
        self.lm_head = nn.Linear(built.hidden_size, built.vocab_size, bias=built.use_bias_in_output)
        if built.share_embedding_weights:
            self.lm_head.weight = self.embedding_layer.word_embeddings.weight
        if not self.lm_head.weight.is_meta:  # shapes only: nothing to draw (and slow on meta)
            self._init_weights()

    def _init_weights(self) -> None:
        specs = initializers(self.built)
        norms = {f"{module_name}.{name}" for module_name, module in self.named_modules()
                 if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) for name, _ in module.named_parameters()}
        for name, param in self.named_parameters():
            if name in norms:
                nn.init.ones_(param) if name.endswith(".weight") else nn.init.zeros_(param)
            elif name.endswith(".bias"):
                nn.init.zeros_(param)
            elif name.endswith("position_embed_helper.slopes"):
                nn.init.xavier_uniform_(param)  # ModelZoo's slopes_initializer
            elif name.startswith("embedding_layer"):
                _initialize(param, specs["embedding"])
            elif name.endswith("proj_output_dense_layer.weight"):
                _initialize(param, specs["output"])
            elif name.endswith("ffn.1.linear_layer.weight"):
                _initialize(param, specs["ffn_output"])
            elif name.endswith(("ffn.0.linear_layer.weight", "ffn.0.linear_layer_for_glu.weight")):
                _initialize(param, specs["ffn_input"])
            elif name.endswith("ffn.gate.weight"):
                _initialize(param, specs["gate"])
            else:
                _initialize(param, specs["block"])

    def rope(self, length: int, device: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        c = self.built
        if c.position_embedding_type != "rotary":
            return None
        return rope_tables(c.rotary_size, length, c.rope_theta, device, scaling_type=c.pos_scaling_type,
                           factor=c.pos_scaling_factor, scaling_args=c.scaling_args)

    def attention_mask(self, length: int, device: Any, window: int | None) -> torch.Tensor | None:
        """None for plain causal attention (SDPA's fused causal path); else the visible keys
        (sliding ``window``), or with ALiBi its bias with -inf where a key is not visible."""
        c = self.built
        if c.position_embedding_type != "alibi":
            return None if window is None else visible_keys(length, window, c.attention_sink_tokens, device)
        bias = self.embedding_layer.position_embed_helper(length, device)
        return bias.masked_fill(~visible_keys(length, window, c.attention_sink_tokens, device), float("-inf"))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) and, when targets are given, the mean cross-entropy over the
        targets that are not -100 (padding in ModelZoo HDF5 data)."""
        c = self.built
        if tokens.shape[1] > c.max_position_embeddings:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds model.max_position_embeddings "
                             f"{c.max_position_embeddings}")
        x = self.embedding_layer(tokens)
        if c.embedding_layer_norm:
            x = self.embedding_ln_f(x)
        if c.embeddings_scale != 1.0:
            x = x * c.embeddings_scale
        x = self.drop_embd(x)
        rope, masks = self.rope(tokens.shape[1], tokens.device), {}
        for index, layer in enumerate(self.transformer_decoder.layers):
            window = c.window_of_layer(index)
            if window not in masks:
                masks[window] = self.attention_mask(tokens.shape[1], tokens.device, window)
            x = layer(x, rope, masks[window])
        logits = self.lm_head(self.transformer_decoder.norm(x))
        if c.logits_scale != 1.0:
            logits = logits * c.logits_scale
        if c.final_logit_softcapping:
            logits = c.final_logit_softcapping * torch.tanh(logits / c.final_logit_softcapping)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        coefficient = (c.moe or {}).get("load_balancing_loss_coef", 0.0)
        if coefficient and c.experts and self.training:  # evaluation reports the LM loss (perplexity)
            loss = loss + coefficient * load_balancing_loss(self.routings())
        return logits, loss

    def routings(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each MoE layer's (router probabilities, 0/1 expert choice), (B, T, experts), of the
        last forward."""
        return [layer.ffn.routing for layer in self.transformer_decoder.layers
                if isinstance(layer.ffn, SparseMoEBlock) and layer.ffn.routing is not None]

    def router_load(self) -> torch.Tensor | None:
        """Each MoE layer's routed-expert load in the last forward, (MoE layers, num_experts): the
        share of the batch's token-to-expert assignments (top_k per token) each expert received,
        so a row sums to 1 and a balanced router gives 1 / num_experts. None without experts."""
        routings = self.routings()
        if not routings:
            return None
        counts = torch.stack([chosen.detach().float().sum((0, 1)) for _, chosen in routings])
        return counts / counts.sum(-1, keepdim=True)

    def num_parameters(self) -> int:
        """Unique parameters (a tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def token_share(self, module_name: str) -> float:
        """The share of tokens a module computes on: top_k / num_experts inside a routed expert
        (each token visits k of them), 1 elsewhere (shared experts see every token)."""
        match = ROUTED_EXPERT.match(module_name)
        if match is None:
            return 1.0
        block = self.transformer_decoder.layers[int(match[1])].ffn
        return block.top_k / block.num_experts if int(match[2]) < block.num_experts else 1.0

    def num_active_parameters(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to."""
        unused = 0
        for layer in self.transformer_decoder.layers:
            if isinstance(layer.ffn, SparseMoEBlock):
                expert = sum(p.numel() for p in layer.ffn.experts.experts[0].parameters())
                unused += (layer.ffn.num_experts - layer.ffn.top_k) * expert
        return self.num_parameters() - unused


def preset_config(name: str, **overrides: Any) -> ModelConfig:
    """A ``model.preset`` (csx_config.PRESETS) as a config, with keys replaced."""
    from csx_config import PRESETS

    if name not in PRESETS:
        raise ValueError(f"model.preset {name!r} is unknown; choose one of {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})


def build_model(config: ModelConfig, seed: int, device: str | None = None) -> Transformer:
    """Build with a private RNG stream so the initial weights depend only on (config, seed).
    ``device="meta"`` builds shapes only (any size, no memory): for plans and validation."""
    if device == "meta":
        with torch.device("meta"):
            return Transformer(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Transformer(config)
