"""ModelZoo's attention: multi-head, grouped-query and multi-query, with rotary positions, an
additive bias or visible-keys mask, and Gemma-2's logit soft-capping."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.positions import apply_rope, visible_keys


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
        self.one_qkv_matmul = False  # Transformer.use_one_qkv_matmul: a GPU run's setting

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        """``mask``: None (causal), bool (T, T) visible keys, or a float additive bias (H, T, T)."""
        def heads(t: torch.Tensor, count: int) -> torch.Tensor:
            return t.unflatten(-1, (count, self.head_dim)).transpose(1, 2)

        q, k, v = self._project(x)
        q, k, v = heads(q, self.num_heads), heads(k, self.kv_heads), heads(v, self.kv_heads)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if mask is not None and mask.is_floating_point():
            mask = mask.to(q.dtype)  # under autocast
        dropout = self.dropout if self.training else 0.0
        if self.softcap is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout,
                                               scale=self.scale, enable_gqa=self.kv_heads != self.num_heads)
        else:
            y = self._softcapped(q, k, v, mask, dropout)
        return self.proj_output_dense_layer(y.transpose(1, 2).flatten(2))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k and v of ``x``: the three projections, or with ``one_qkv_matmul`` one matmul of
        their weights stacked (nanoGPT's c_attn), where they are plain linears no hook watches.
        A GPU step is its host's kernel launches: one matmul and a concatenation instead of
        three matmuls forward, six backward and the sum of their input gradients. Off by
        default: on a CPU the three products, bit for bit those of ModelZoo's separate
        layers."""
        layers = (self.proj_q_dense_layer, self.proj_k_dense_layer, self.proj_v_dense_layer)
        if not (self.one_qkv_matmul and all(_unwatched_linear(layer) for layer in layers)):
            return tuple(layer(x) for layer in layers)
        weight = torch.cat([layer.weight for layer in layers])
        bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
        return F.linear(x, weight, bias).split([layer.out_features for layer in layers], dim=-1)

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


def _unwatched_linear(module: nn.Module) -> bool:
    """A plain ``nn.Linear`` (not the fabric's CSR layer) without hooks of its own, whose call is
    its matmul alone. (The sparsity library's hooks are on the parameters and the optimizer.)"""
    return type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks
