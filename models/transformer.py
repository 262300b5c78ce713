"""The decoder, ``Transformer``: embeddings, the stack of decoder layers, the head and the loss,
with ModelZoo's parameter names; ``build_model`` seeds it.

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

and with ``moe`` ``ffn.gate.weight`` and the experts as the file's release names them
(models/moe.py).

The default sparsity filter (matrices whose name has no "embedding" / "norm" / "lm_head")
therefore picks exactly the attention and FFN projections of every block.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.blocks import EmbeddingLayer, TransformerDecoder, make_norm
from models.config import ModelConfig
from models.initializers import _initialize, initializers
from models.moe import ExpertsLinear, SparseMoEBlock, expert_parts, load_balancing_loss
from models.positions import rope_tables, visible_keys


# An FFN layer's weight, dense or of the experts in any layout: (layer 0 = input, 1 = output).
FFN_WEIGHT = re.compile(r"(?:\bffn|fused_ffns|experts\.\d+)\.(\d)\.linear_layer(?:_for_glu)?\.(?:weight|expert_weights)$")


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
            elif name.endswith((".bias", ".expert_biases")):
                nn.init.zeros_(param)
            elif name.endswith("position_embed_helper.slopes"):
                nn.init.xavier_uniform_(param)  # ModelZoo's slopes_initializer
            elif name.startswith("embedding_layer"):
                _initialize(param, specs["embedding"])
            elif name.endswith("proj_output_dense_layer.weight"):
                _initialize(param, specs["output"])
            elif FFN_WEIGHT.search(name):
                _initialize(param, specs["ffn_input" if FFN_WEIGHT.search(name)[1] == "0" else "ffn_output"])
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

    def use_one_qkv_matmul(self, enabled: bool = True) -> None:
        """Every attention layer's q, k and v in one matmul (MultiheadAttention._project): a GPU
        run's setting (training.build.build_run); the parameters stay three per layer."""
        for layer in self.transformer_decoder.layers:
            layer.self_attn.one_qkv_matmul = enabled

    def num_parameters(self) -> int:
        """Unique parameters (a tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def weight_matrices(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(module name, parameter name, weight) of every matmul: the linear layers and the
        fused experts' (out, experts, in) weights."""
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                yield name, f"{name}.weight", module.weight
            elif isinstance(module, ExpertsLinear):
                yield name, f"{name}.expert_weights", module.expert_weights

    def token_share(self, module_name: str) -> float:
        """The share of tokens a module computes on: top_k / num_experts inside a routed expert
        (each token visits k of them), 1 elsewhere (shared experts see every token); the mean
        over the experts a fused module holds."""
        parts = expert_parts(self, module_name + ".")
        if not parts:
            return 1.0
        block = self.transformer_decoder.layers[parts[0][0]].ffn
        routed = sum(label.startswith("expert") for _, label, _ in parts)
        return (routed * block.top_k / block.num_experts + len(parts) - routed) / len(parts)

    def num_active_parameters(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to."""
        unused = sum(layer.ffn.routed_parameters() * (layer.ffn.num_experts - layer.ffn.top_k) // layer.ffn.num_experts
                     for layer in self.transformer_decoder.layers if isinstance(layer.ffn, SparseMoEBlock))
        return self.num_parameters() - unused


class _ShapesOnly(torch.overrides.TorchFunctionMode):
    """Skips the fills torch's own modules draw their initial weights with (nn.Linear's
    kaiming_uniform_, nn.Embedding's normal_, our initializers' truncated normals) on meta
    tensors, which hold no values: on meta they run torch's Python reference kernels, most of
    the time of building a model's shapes, and a plan builds one at every admission. The
    nn.init functions are caught whole: torch hands them to a mode before their own tensor ops,
    which run with the mode set aside. Only value-writing ops: shape-changing in-place ops
    (resize_, t_, ...) and requires_grad_ still run. A mode, so other threads' models are
    untouched."""

    FILLS = frozenset({
        torch.nn.init.uniform_, torch.nn.init.normal_, torch.nn.init.constant_,
        torch.nn.init.kaiming_uniform_,
        *(getattr(torch.Tensor, name) for name in (
            "uniform_", "normal_", "fill_", "zero_", "erfinv_", "mul_", "add_", "clamp_"))})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FILLS:
            # nn.init passes its tensor by keyword, Tensor methods positionally
            tensor = args[0] if args else (kwargs or {})["tensor"]
            if tensor.is_meta:
                return tensor
        return func(*args, **(kwargs or {}))


def build_model(config: ModelConfig, seed: int, device: str | None = None) -> Transformer:
    """Build with a private RNG stream so the initial weights depend only on (config, seed).
    ``device="meta"`` builds shapes only (any size, no memory): for plans and validation."""
    if device == "meta":
        with torch.device("meta"), _ShapesOnly():
            return Transformer(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Transformer(config)
