"""The memory a job's training takes, from its spec alone: arithmetic on shapes, without torch.

Admission (the service on every path that queues a job, ``csx run`` before it builds anything)
compares this estimate with what the workers have, so a model far too big is refused in
microseconds whatever its size, instead of being built or allocated: the one memory rule of a
job. ``training.report`` reports the same numbers from the model it builds on the meta device; a
test keeps the parameter count here equal to that model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from csx_config import JobSpec, OptimizerSpec
from models.config import ModelConfig
from training.data import planned_vocab_size

FLOAT_BYTES = 4
HALF_BYTES = 2  # an activation kept under 16-bit autocast


@dataclass(frozen=True)
class Shapes:
    """The widths that size a run: the model as built (Sparse-Wide applied) and the batch."""

    vocab_size: int
    hidden_size: int
    filter_size: int
    num_hidden_layers: int
    num_heads: int
    is_glu: bool
    seq_len: int


def shapes_of(model: ModelConfig, seq_len: int) -> Shapes:
    """The widths of `model` as built (Sparse-Wide applied) at `seq_len` tokens per sequence."""
    c = model.widened()
    return Shapes(vocab_size=c.vocab_size, hidden_size=c.hidden_size, filter_size=c.filter_size,
                  num_hidden_layers=c.num_hidden_layers, num_heads=c.num_heads, is_glu=c.is_glu,
                  seq_len=seq_len)


def planned_model(spec: JobSpec) -> ModelConfig:
    """The model `spec` builds, with the vocabulary planned from the spec alone."""
    return ModelConfig(**{**spec.model.resolved(), "vocab_size": planned_vocab_size(spec)})


def parameter_count(model: ModelConfig) -> tuple[int, int]:
    """(unique parameters, entries of the matrices a sparsity section may mask) of `model` as
    built."""
    c = model.widened()
    h, f, glu = c.hidden_size, c.filter_size, c.is_glu
    norm = (1 if c.norm_type == "rmsnorm" else 2) * h
    inner, kv = c.inner_dim, c.kv_heads * c.head_dim  # all query heads; key (or value) heads
    attention_matrices = 2 * h * inner + 2 * h * kv
    attention = (attention_matrices + (inner + 2 * kv) * c.use_projection_bias_in_attention
                 + h * c.use_ffn_bias_in_attention)
    ffn_in = (2 if glu else 1) * h * f
    ffn = ffn_in + f * h + c.use_ffn_bias * ((2 if glu else 1) * f + h)
    layers = c.num_hidden_layers * (2 * norm + attention + ffn) + norm
    embeddings = c.vocab_size * h + (c.max_position_embeddings * h
                                     if c.position_embedding_type == "learned" else 0)
    if c.position_embedding_type == "alibi" and c.alibi_trainable_slopes:
        embeddings += c.num_heads
    if c.embedding_layer_norm:
        embeddings += norm
    head = (0 if c.share_embedding_weights else c.vocab_size * h) + c.vocab_size * c.use_bias_in_output
    matrices = c.num_hidden_layers * (attention_matrices + ffn_in + f * h)
    return layers + embeddings + head, matrices


def autocasts(model_keys: dict[str, Any]) -> bool:
    """Whether ModelZoo's precision keys ask for 16-bit autocast (``model.mixed_precision`` or
    ``model.use_bfloat16``); training.precision applies it, on CUDA only."""
    return bool(model_keys.get("mixed_precision")) or bool(model_keys.get("use_bfloat16"))


def training_memory(optimizer: OptimizerSpec, batch: int, s: Shapes, parameters: int,
                    sparse_weights: int, activation_bytes: int) -> dict[str, int]:
    """Bytes one worker needs to train: fp32 weights, gradients and optimizer state, masks,
    and the activations kept for backward of its slice of `batch` sequences (per layer and
    token: ~10 hidden-size vectors, the FFN's hidden units, the attention scores; plus logits
    and their gradient), `activation_bytes` each."""
    name = optimizer.optimizer_type.lower()
    state_floats = 2 if "adam" in name else 1 if optimizer.momentum else 0
    per_token_layer = (10 * s.hidden_size + (3 if s.is_glu else 2) * s.filter_size
                       + s.num_heads * s.seq_len)
    activations = batch * s.seq_len * (s.num_hidden_layers * per_token_layer + 2 * s.vocab_size)
    return {"weights": parameters * FLOAT_BYTES, "gradients": parameters * FLOAT_BYTES,
            "optimizer_state": state_floats * parameters * FLOAT_BYTES, "masks": sparse_weights,
            "activations": activations * activation_bytes}


def estimate(spec: JobSpec, num_csx: int, on_gpu: bool = False) -> dict[str, int]:
    """training_memory per worker from the spec alone (see _estimate)."""
    return _estimate(spec, num_csx, on_gpu)[0]


def _estimate(spec: JobSpec, num_csx: int, on_gpu: bool) -> tuple[dict[str, int], int]:
    """(training_memory per worker, parameters); masks are counted for every matrix when there
    is a sparsity section (an upper bound: a param_filter may mask fewer). Activations are
    16-bit where the precision keys apply, on a GPU."""
    model = planned_model(spec)
    # An HDF5 run without max_sequence_length is sized at the longest sequence the model takes.
    s = shapes_of(model, spec.train_input.max_sequence_length or model.max_position_embeddings)
    parameters, matrices = parameter_count(model)
    half = on_gpu and autocasts(spec.model.model_extra or {})
    memory = training_memory(spec.optimizer, spec.train_input.batch_size // num_csx, s, parameters,
                             matrices if spec.sparsity is not None else 0, HALF_BYTES if half else FLOAT_BYTES)
    return memory, parameters


def too_big(spec: JobSpec, num_csx: int, per_worker_limit: int) -> str | None:
    """Why the job cannot train with `per_worker_limit` bytes per worker, or None."""
    memory, parameters = _estimate(spec, num_csx, on_gpu=False)
    need = sum(memory.values())
    if need <= per_worker_limit:
        return None
    return (f"this job does not fit: training needs an estimated {_gib(need)} per worker "
            f"({_parts(memory)}; {parameters:,} parameters) but each of the {num_csx} worker(s) "
            f"has {_gib(per_worker_limit)}: train a scaled-down proxy (smaller hidden_size / "
            "num_hidden_layers / batch_size) or use more CS-2 systems")


def too_big_for_gpu(spec: JobSpec, num_csx: int, gpu_memory: float) -> str | None:
    """Why the job cannot train on GPUs of `gpu_memory` bytes, one per system, or None."""
    memory, parameters = _estimate(spec, num_csx, on_gpu=True)
    need = sum(memory.values())
    if need <= gpu_memory:
        return None
    precision = "16-bit activations" if autocasts(spec.model.model_extra or {}) else "float32"
    return (f"training on a GPU needs an estimated {_gib(need)} of GPU memory per system "
            f"({_parts(memory)}; {parameters:,} parameters, {precision}) but each GPU has "
            f"{_gib(gpu_memory)}: use more CS-2 systems (num_csx), a smaller model or batch, "
            "model.mixed_precision, or gpus_per_csx: 0 to train on CPUs")


def _parts(memory: dict[str, int]) -> str:
    return ", ".join(f"{k} {_gib(v)}" for k, v in memory.items())


def _gib(value: int) -> str:
    return f"{value / 2**30:,.2f} GiB"
