"""A small Llama-style decoder (RMSNorm, RoPE, SwiGLU), readable in one sitting.

Parameter names are chosen so ModelZoo-style globs can target them:
``embedding.weight``, ``layers.{i}.attn.{q,k,v,o}_proj.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{attn,mlp}_norm.weight``,
``norm.weight`` and ``lm_head.weight`` (absent from ``named_parameters`` when tied to the
embedding). Linear layers have no bias, so the default sparsity filter picks exactly the seven
projections of every block.

Sparse-Wide (Sparse-IFT, Thangarasa et al. 2023, arXiv:2303.11525): with
``sparse_wide_sparsity = s`` the widths of everything inside the blocks are multiplied by
``k = 1/sqrt(1 - s)``: the residual stream (``d_model``, through a wider ``head_dim`` with the
same number of heads) and the FFN width (``d_ff``). Every block projection then has ``k**2``
times the weights of the dense one, so at sparsity ``s`` its non-zeros and FLOPs per token equal
the dense layer's. The embedding, the final norm and ``lm_head`` are not sparsified (they are
excluded by name), but their width follows the residual stream, so ``lm_head``'s FLOPs grow by
``k``; the attention scores (``QKᵀ`` and ``AV``) are dense matmuls whose cost grows by ``k`` too.
Those costs are reported separately by ``workers.plan``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    max_seq_len: int = 128
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    d_ff: int = 192
    tie_embeddings: bool = True
    sparse_wide_sparsity: float = 0.0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "n_layer", "n_head", "d_model", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be n_head ({self.n_head}) times an even "
                "head_dim (RoPE rotates pairs of channels)")
        if not 0.0 <= self.sparse_wide_sparsity < 1.0:
            raise ValueError(
                f"model.sparse_wide_sparsity must be in [0, 1), got {self.sparse_wide_sparsity}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def widened(self) -> ModelConfig:
        """The config actually built: Sparse-Wide widths applied (identity when s = 0)."""
        if self.sparse_wide_sparsity == 0.0:
            return self
        k = 1.0 / math.sqrt(1.0 - self.sparse_wide_sparsity)
        head_dim = 2 * max(1, round(self.head_dim * k / 2))  # RoPE needs an even head_dim
        return replace(self, d_model=head_dim * self.n_head, d_ff=max(1, round(self.d_ff * k)),
                       sparse_wide_sparsity=0.0)


# d_ff ≈ 8/3 · d_model rounded to a multiple of 32, as in Llama.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(n_layer=2, n_head=4, d_model=64, d_ff=160, max_seq_len=128),
    "mini": ModelConfig(n_layer=4, n_head=4, d_model=128, d_ff=352, max_seq_len=256),
    "small": ModelConfig(n_layer=8, n_head=8, d_model=256, d_ff=672, max_seq_len=256),
}


def preset_config(name: str, **overrides: object) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"model.preset {name!r} is unknown; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, head_dim // 2) for rotating channel pairs."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (even, odd) channel pairs of x (B, H, T, D) by position-dependent angles."""
    seq = x.shape[-2]
    cos, sin = cos[:seq], sin[:seq]
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2)

        q = apply_rope(heads(self.q_proj(x)), cos, sin)
        k = apply_rope(heads(self.k_proj(x)), cos, sin)
        y = F.scaled_dot_product_attention(q, k, heads(self.v_proj(x)), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config  # as requested; `built` holds the Sparse-Wide widths
        built = config.widened()
        self.built = built
        self.embedding = nn.Embedding(built.vocab_size, built.d_model)
        self.layers = nn.ModuleList(Block(built) for _ in range(built.n_layer))
        self.norm = RMSNorm(built.d_model, built.norm_eps)
        self.lm_head = nn.Linear(built.d_model, built.vocab_size, bias=False)
        if built.tie_embeddings:
            self.lm_head.weight = self.embedding.weight
        cos, sin = rope_tables(built.head_dim, built.max_seq_len, built.rope_theta)
        # Not persistent: derived from the config, so checkpoints hold only learned state.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2 / nanoGPT: scale the projections that write into the residual stream.
        for name, param in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * built.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) and, when targets are given, the mean cross-entropy."""
        if tokens.shape[1] > self.built.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds model max_seq_len {self.built.max_seq_len}")
        x = self.embedding(tokens)
        for block in self.layers:
            x = block(x, self.rope_cos, self.rope_sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def num_parameters(self) -> int:
        """Unique parameters (a tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())


def build_model(config: ModelConfig, seed: int) -> Transformer:
    """Build with a private RNG stream so the initial weights depend only on (config, seed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Transformer(config)
