"""One pre-norm decoder for the GPT-2/3 and Llama families, with ModelZoo's parameter names.

GPT-2/3: learned positions, LayerNorm, GELU, biases. Llama: rotary positions, RMSNorm, SwiGLU,
no biases. Everything is picked by ModelZoo's model keys (``ModelConfig`` mirrors them), and the
parameters are named as ModelZoo's ``GPT2LMHeadModel`` names them, so a ModelZoo
``param_filter`` / ``param_name_patterns`` selects exactly the layers it selects there::

    embedding_layer.word_embeddings.weight, embedding_layer.position_embeddings.weight
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
and ``lm_head`` stay dense, but their width follows the residual stream (``workers.plan``
reports those costs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

GLU_ACTIVATIONS = {"swiglu": F.silu, "geglu": F.gelu, "reglu": F.relu}
ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
               "silu": F.silu, "swish": F.silu}


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
    share_embedding_weights: bool = True
    nonlinearity: str = "swiglu"
    norm_type: str = "rmsnorm"
    layer_norm_epsilon: float = 1e-5
    attention_type: str = "scaled_dot_product"
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
    sparse_wide_sparsity: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "filter_size",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size ({self.hidden_size}) must be a multiple of "
                             f"num_heads ({self.num_heads})")
        if self.position_embedding_type == "rotary" and (
                self.rotary_size % 2 or self.rotary_size > self.head_dim):
            raise ValueError(f"model.rotary_dim ({self.rotary_size}) must be even and at most the "
                             f"head size hidden_size / num_heads = {self.head_dim}")
        if self.nonlinearity not in GLU_ACTIVATIONS and self.nonlinearity not in ACTIVATIONS:
            raise ValueError(f"model.nonlinearity {self.nonlinearity!r} is not one of "
                             f"{sorted({**GLU_ACTIVATIONS, **ACTIVATIONS})}")
        if not 0.0 <= self.sparse_wide_sparsity < 1.0:
            raise ValueError(
                f"model.sparse_wide_sparsity must be in [0, 1), got {self.sparse_wide_sparsity}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rotary_size(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def is_glu(self) -> bool:
        return self.nonlinearity in GLU_ACTIVATIONS

    def widened(self) -> ModelConfig:
        """The config actually built: Sparse-Wide widths applied (identity when s = 0)."""
        if self.sparse_wide_sparsity == 0.0:
            return self
        k = 1.0 / math.sqrt(1.0 - self.sparse_wide_sparsity)
        head_dim = 2 * max(1, round(self.head_dim * k / 2))  # rotary needs an even head size
        rotary = None if self.rotary_dim is None else min(head_dim, 2 * round(self.rotary_dim * k / 2))
        return replace(self, hidden_size=head_dim * self.num_heads, rotary_dim=rotary,
                       filter_size=max(1, round(self.filter_size * k)), sparse_wide_sparsity=0.0)


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


def rope_tables(rotary_dim: int, length: int, theta: float, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (length, rotary_dim // 2) for rotating channel pairs."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (even, odd) channel pairs of the first ``2 * cos.shape[-1]`` channels of x
    (B, H, T, D) by position-dependent angles; the other channels pass through."""
    seq, rotated_dims = x.shape[-2], 2 * cos.shape[-1]
    cos, sin = cos[:seq], sin[:seq]
    part, rest = x[..., :rotated_dims], x[..., rotated_dims:]
    even, odd = part[..., 0::2], part[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


class MultiheadAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        width, bias = config.hidden_size, config.use_projection_bias_in_attention
        self.num_heads = config.num_heads
        self.proj_q_dense_layer = nn.Linear(width, width, bias=bias)
        self.proj_k_dense_layer = nn.Linear(width, width, bias=bias)
        self.proj_v_dense_layer = nn.Linear(width, width, bias=bias)
        self.proj_output_dense_layer = nn.Linear(width, width, bias=config.use_ffn_bias_in_attention)
        self.dropout = config.attention_dropout_rate
        # dot_product: QKᵀ unscaled (SDPA's scale argument); scaled_dot_product: QKᵀ / sqrt(d).
        self.scale = 1.0 if config.attention_type == "dot_product" else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        batch, seq, width = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.num_heads, width // self.num_heads).transpose(1, 2)

        q, k = heads(self.proj_q_dense_layer(x)), heads(self.proj_k_dense_layer(x))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = F.scaled_dot_product_attention(q, k, heads(self.proj_v_dense_layer(x)), is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0, scale=self.scale)
        return self.proj_output_dense_layer(y.transpose(1, 2).reshape(batch, seq, width))


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


class DecoderLayer(nn.Module):
    """Pre-norm: x + attn(norm1(x)), then x + ffn(norm3(x)) (norm2 is ModelZoo's cross-attention)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm1 = make_norm(config)
        self.self_attn = MultiheadAttention(config)
        self.norm3 = make_norm(config)
        self.ffn = FeedForwardNetwork(config)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.norm1(x), rope))
        return x + self.dropout(self.ffn(self.norm3(x)))


class TransformerDecoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = make_norm(config)


class EmbeddingLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding_type == "learned":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)
        if hasattr(self, "position_embeddings"):
            x = x + self.position_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        return x


INIT_FUNCTIONS = {"normal": nn.init.normal_, "truncated_normal": nn.init.trunc_normal_,
                  "uniform": nn.init.uniform_, "xavier_uniform": nn.init.xavier_uniform_,
                  "xavier_normal": nn.init.xavier_normal_, "zeros": nn.init.zeros_, "ones": nn.init.ones_}


def _initialize(param: torch.Tensor, spec: dict[str, Any] | None, std: float) -> None:
    """A ModelZoo initializer dict ({name: truncated_normal, mean, std, a, b}, ...); None is
    ModelZoo's default, a truncated normal of ``std`` cut at two standard deviations."""
    spec = spec or {"name": "truncated_normal", "std": std, "a": -2 * std, "b": 2 * std}
    args = {k: v for k, v in spec.items() if k != "name"}
    INIT_FUNCTIONS[spec["name"]](param, **args)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config  # as requested; `built` holds the Sparse-Wide widths
        built = config.widened()
        self.built = built
        self.embedding_layer = EmbeddingLayer(built)
        self.drop_embd = nn.Dropout(built.dropout_rate if built.embedding_dropout_rate is None
                                    else built.embedding_dropout_rate)
        self.transformer_decoder = TransformerDecoder(built)
        self.lm_head = nn.Linear(built.hidden_size, built.vocab_size, bias=built.use_bias_in_output)
        if built.share_embedding_weights:
            self.lm_head.weight = self.embedding_layer.word_embeddings.weight
        self._init_weights()

    def _init_weights(self) -> None:
        c = self.built
        # As ModelZoo: projections writing into the residual stream default to std / sqrt(2L).
        output_std = c.initializer_range / math.sqrt(2 * c.num_hidden_layers)
        for name, param in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(param)
            elif "norm" in name:
                nn.init.ones_(param)
            elif name.startswith("embedding_layer"):
                _initialize(param, c.embedding_initializer, c.initializer_range)
            elif name.endswith(("proj_output_dense_layer.weight", "ffn.1.linear_layer.weight")):
                _initialize(param, c.output_layer_initializer or c.initializer, output_std)
            else:
                _initialize(param, c.initializer, c.initializer_range)

    def rope(self, length: int, device: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        c = self.built
        return rope_tables(c.rotary_size, length, c.rope_theta, device) if c.position_embedding_type == "rotary" else None

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) and, when targets are given, the mean cross-entropy over the
        targets that are not -100 (padding in ModelZoo HDF5 data)."""
        if tokens.shape[1] > self.built.max_position_embeddings:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds model.max_position_embeddings "
                             f"{self.built.max_position_embeddings}")
        x = self.drop_embd(self.embedding_layer(tokens))
        rope = self.rope(tokens.shape[1], tokens.device)
        for layer in self.transformer_decoder.layers:
            x = layer(x, rope)
        logits = self.lm_head(self.transformer_decoder.norm(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def num_parameters(self) -> int:
        """Unique parameters (a tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())


def preset_config(name: str, **overrides: Any) -> ModelConfig:
    """A ``model.preset`` (workers.spec.PRESETS) as a config, with keys replaced."""
    from workers.spec import PRESETS

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
