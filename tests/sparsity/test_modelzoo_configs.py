"""The ModelZoo GPT-3 125M sparsity blocks: the 2.10 layout and its 2.1 legacy twin configure the
same groups, hyper-parameters and masks.

The blocks are the ``sparsity:`` sections of
``src/cerebras/modelzoo/models/nlp/gpt3/configs/sparsity/pretraining/params_gpt3_125m_{static75,
rigl75,set75}.yaml`` (2.10) and of the same files under
``modelzoo/transformers/pytorch/gpt3/configs/sparsity/pretraining/`` (2.1): globs under
``param_filter`` became regexes under ``param_name_patterns``, ``algorithm`` was ``type`` and
``update`` was ``schedule``.
"""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from torch import nn

import sparsity
from sparsity.config import configure
from sparsity.masks import keep_count

STATIC_2_10 = """
sparsity:
    sparsity: 0.75
    init_method: "random"
    param_filter:
      - "*proj_[qkv]_dense_layer.weight"
      - "*proj_output_dense_layer.weight"
      - "*linear_layer.weight"
"""
STATIC_2_1 = """
sparsity:
    sparsity: 0.75
    init_method: "random"
    type: "static"
    param_name_patterns:
      - ".*proj_[qkv]_dense_layer.weight"
      - ".*proj_output_dense_layer.weight"
      - ".*linear_layer.weight"
"""
RIGL_2_10 = """
sparsity:
    sparsity: 0.75
    init_method: "random"
    algorithm: "rigl"
    drop_fraction:
      type: "cosine" # anneal drop fraction with cosine schedule
      init: 0.3
      half_period: 3584 # set half-period to schedule at 75% of max_steps
    update:
      freq: 100 # update every 100 steps
      stop: 3584 # stop updates at step 3584 (not inclusive)
    param_filter:
      - "*proj_[qkv]_dense_layer.weight"
      - "*proj_output_dense_layer.weight"
      - "*linear_layer.weight"
"""
RIGL_2_1 = """
sparsity:
    sparsity: 0.75
    init_method: "random"
    type: "rigl"
    drop_fraction:
      type: "cosine" # anneal drop fraction with cosine schedule
      init: 0.3
      half_period: 3584 # set half-period to schedule at 75% of max_steps
    schedule:
      freq: 100 # update every 100 steps
      stop: 3584 # stop updates at step 3584 (not inclusive)
    param_name_patterns:
      - ".*proj_[qkv]_dense_layer.weight"
      - ".*proj_output_dense_layer.weight"
      - ".*linear_layer.weight"
"""
SET_2_10 = RIGL_2_10.replace('algorithm: "rigl"', "algorithm: set")
SET_2_1 = RIGL_2_1.replace('type: "rigl"', 'type: "set"')

PAIRS = {
    "static75": (STATIC_2_10, STATIC_2_1, sparsity.Static),
    "rigl75": (RIGL_2_10, RIGL_2_1, sparsity.RigL),
    "set75": (SET_2_10, SET_2_1, sparsity.SET),
}
N_LAYER, D_MODEL, D_FF, VOCAB, SEQ = 2, 16, 64, 50, 8


# ------------------------------------------------------------ a GPT-3 with ModelZoo's names
class Dense(nn.Module):
    """ModelZoo's ``SingleFeedForwardLayer``: the weights sit under ``linear_layer``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear_layer = nn.Linear(d_in, d_out)


class FeedForwardNetwork(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ffn = nn.ModuleList([Dense(D_MODEL, D_FF), Dense(D_FF, D_MODEL)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = nn.functional.gelu(self.ffn[0].linear_layer(x))
        return self.ffn[1].linear_layer(hidden)


class MultiheadAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj_q_dense_layer = nn.Linear(D_MODEL, D_MODEL)
        self.proj_k_dense_layer = nn.Linear(D_MODEL, D_MODEL)
        self.proj_v_dense_layer = nn.Linear(D_MODEL, D_MODEL)
        self.proj_output_dense_layer = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj_q_dense_layer(x), self.proj_k_dense_layer(x), self.proj_v_dense_layer(x)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj_output_dense_layer(y)


class DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = MultiheadAttention()
        self.norm1 = nn.LayerNorm(D_MODEL)
        self.norm3 = nn.LayerNorm(D_MODEL)
        self.ffn = FeedForwardNetwork()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x))
        return x + self.ffn(self.norm3(x))


class TransformerDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(N_LAYER))
        self.norm = nn.LayerNorm(D_MODEL)


class EmbeddingLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, D_MODEL)
        self.position_embeddings = nn.Embedding(SEQ, D_MODEL)  # position_embedding_type: learned


class GPT3(nn.Module):
    """Parameter names as in ModelZoo's GPT-3, e.g.
    ``transformer_decoder.layers.0.self_attn.proj_q_dense_layer.weight``,
    ``transformer_decoder.layers.0.ffn.ffn.1.linear_layer.bias``; the head shares the word
    embedding (``share_embedding_weights: True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding_layer = EmbeddingLayer()
        self.transformer_decoder = TransformerDecoder()
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.lm_head.weight = self.embedding_layer.word_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1])
        x = self.embedding_layer.word_embeddings(tokens) + self.embedding_layer.position_embeddings(positions)
        for layer in self.transformer_decoder.layers:
            x = layer(x)
        return self.lm_head(self.transformer_decoder.norm(x))


SPARSE_NAMES = sorted(
    f"transformer_decoder.layers.{i}.{leaf}.weight"
    for i in range(N_LAYER)
    for leaf in ("self_attn.proj_q_dense_layer", "self_attn.proj_k_dense_layer",
                 "self_attn.proj_v_dense_layer", "self_attn.proj_output_dense_layer",
                 "ffn.ffn.0.linear_layer", "ffn.ffn.1.linear_layer")
)


def build(config_yaml: str) -> tuple[GPT3, sparsity.SparsityAlgorithm]:
    torch.manual_seed(0)
    model = GPT3()
    alg = configure(yaml.safe_load(config_yaml)["sparsity"])
    model.apply(alg)
    return model, alg


def masks(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name[: -len("_mask")]: buf.clone() for name, buf in model.named_buffers() if name.endswith("_mask")}


def train(model: nn.Module, alg: sparsity.SparsityAlgorithm, steps: int) -> None:
    """AdamW as in the 125M configs (betas 0.9/0.95, weight decay 0.1), fixed token stream."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    alg.apply(optimizer)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=generator)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("new, legacy, cls", PAIRS.values(), ids=PAIRS.keys())
def test_both_layouts_build_the_same_algorithm_on_the_same_parameters(new, legacy, cls):
    (model_new, alg_new), (model_legacy, alg_legacy) = build(new), build(legacy)
    assert type(alg_new) is cls and type(alg_legacy) is cls
    names_new = sorted(name for name, _, _ in alg_new.sparse_parameters())
    names_legacy = sorted(name for name, _, _ in alg_legacy.sparse_parameters())
    # exactly the q/k/v/output projections and both FFN weights: no bias, embedding or norm
    assert names_new == names_legacy == SPARSE_NAMES
    for name, mask in masks(model_new).items():
        assert int(mask.sum()) == keep_count(mask.numel(), 0.75), name
        assert torch.equal(mask, masks(model_legacy)[name]), name


@pytest.mark.parametrize("pair", ["rigl75", "set75"])
def test_both_layouts_have_the_same_schedules(pair):
    new, legacy, _ = PAIRS[pair]
    algs = [configure(yaml.safe_load(block)["sparsity"]) for block in (new, legacy)]
    # RigL's cosine drop fraction: 0.3/2 · (1 + cos(π t / 3584)), cstorch's formula, which
    # rises again after 3584, where the updates have stopped
    steps = [0, 100, 1792, 3500, 3584, 4000]
    expected = [0.15 * (1 + math.cos(math.pi * t / 3584)) for t in steps]
    update_steps = list(range(100, 3584, 100))  # every 100 steps, stop 3584 exclusive
    for alg in algs:
        assert [alg.drop_fraction(t) for t in steps] == pytest.approx(expected)
        assert alg.drop_fraction(1792) == pytest.approx(0.15)
        assert [t for t in range(1, 5000) if alg.is_update_step(t)] == update_steps
        assert alg.target_sparsity(0) == alg.target_sparsity(4000) == 0.75
        assert alg.init_method == "random" and alg.seed == 0


@pytest.mark.parametrize("new, legacy, cls", PAIRS.values(), ids=PAIRS.keys())
def test_both_layouts_train_to_identical_masks(new, legacy, cls):
    """101 optimizer steps cross the first update (step 100); masks and weights stay identical."""
    (model_new, alg_new), (model_legacy, alg_legacy) = build(new), build(legacy)
    before = masks(model_new)
    train(model_new, alg_new, 101)
    train(model_legacy, alg_legacy, 101)
    after_new, after_legacy = masks(model_new), masks(model_legacy)
    changed = False
    for name in SPARSE_NAMES:
        assert torch.equal(after_new[name], after_legacy[name]), name
        assert int(after_new[name].sum()) == keep_count(after_new[name].numel(), 0.75)
        changed |= not torch.equal(after_new[name], before[name])
    assert changed == (cls is not sparsity.Static)
    for (name, a), b in zip(model_new.state_dict().items(), model_legacy.state_dict().values()):
        assert torch.equal(a, b), name
