"""The decoder's blocks: norms, the decoder layer (sequential or parallel), the stack of layers
and the embedding layer."""

from __future__ import annotations

import torch
from torch import nn

from models.attention import MultiheadAttention
from models.config import ModelConfig
from models.ffn import FeedForwardNetwork
from models.moe import SparseMoEBlock
from models.positions import AlibiPositions


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon,
                        bias=config.norm_type != "biasless-layernorm")  # MPT: no bias


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
