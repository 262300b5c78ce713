"""Turning a ``JobSpec`` into the objects of a run: model config, tokenizer and token streams,
optimizer with its LR schedule, and the sparsity algorithm. Shared by ``train`` and ``plan``."""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from workers.data import Tokenizer, encode_documents, load_splits, make_tokenizer, save_tokenizer, tokenizer_from_json
from workers.model import ModelConfig, Transformer, build_model, preset_config
from workers.spec import JobSpec, OptimizerSpec, WarmupCosineSpec

TOKENIZER_FILE = "tokenizer.json"


def model_config(spec: JobSpec, vocab_size: int) -> ModelConfig:
    """Preset (or bare defaults) + size overrides, with the tokenizer's vocabulary and a RoPE
    table long enough for both train and eval sequences."""
    overrides = spec.model.size_overrides()
    base = preset_config(spec.model.preset, **overrides) if spec.model.preset else ModelConfig(**overrides)
    longest = max(base.max_seq_len, spec.train_input.seq_len, spec.eval_input.seq_len)
    return replace(base, vocab_size=vocab_size, max_seq_len=longest)


def build_sparse_model(spec: JobSpec, config: ModelConfig) -> tuple[Transformer, Any]:
    """The model (seeded by runconfig.seed) and, when the spec has a sparsity section, the
    configured algorithm applied to it (masks exist on return)."""
    model = build_model(config, seed=spec.runconfig.seed)
    if spec.sparsity is None:
        return model, None
    import sparsity

    algorithm = sparsity.configure(_with_default_seed(spec.sparsity, spec.runconfig.seed))
    algorithm.apply(model)
    return model, algorithm


def _with_default_seed(config: Any, seed: int) -> Any:
    """runconfig.seed seeds the masks too, unless the sparsity config names its own seed."""
    if isinstance(config, (int, float)):
        return {"sparsity": config, "seed": seed}
    if isinstance(config, list):
        return [_with_default_seed(group, seed) if isinstance(group, dict) else group for group in config]
    return {"seed": seed, **config}


def load_tokenizer(spec: JobSpec, model_dir: Path | None, train_texts: list[str],
                   save: bool) -> Tokenizer:
    """The run's saved tokenizer when model_dir has one (so evaluation matches training);
    otherwise a new one from the spec, saved to model_dir when ``save``."""
    saved = model_dir / TOKENIZER_FILE if model_dir else None
    if saved and saved.is_file():
        return tokenizer_from_json(json.loads(saved.read_text(encoding="utf-8")))
    tokenizer = make_tokenizer(spec.model.tokenizer.type, spec.model.tokenizer.vocab_size, train_texts)
    if saved and save:
        saved.parent.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tokenizer, saved)
    return tokenizer


def token_streams(spec: JobSpec, model_dir: Path | None, *, save_tokenizer_file: bool
                  ) -> tuple[Tokenizer, torch.Tensor, torch.Tensor]:
    """(tokenizer, train tokens, validation tokens) for the spec's inputs."""
    train_splits = load_splits(spec.train_input.data_dir)
    eval_dir = spec.eval_data_dir()
    eval_splits = train_splits if eval_dir == spec.train_input.data_dir else load_splits(eval_dir)
    tokenizer = load_tokenizer(spec, model_dir, train_splits.train, save_tokenizer_file)
    return (tokenizer, encode_documents(tokenizer, train_splits.train),
            encode_documents(tokenizer, eval_splits.validation))


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    names = sorted(n for n, c in vars(torch.optim).items()
                   if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer)
                   and c is not torch.optim.Optimizer)
    cls = getattr(torch.optim, name, None)
    if name not in names or cls is None:
        raise ValueError(f"optimizer.type {name!r} is not a torch.optim optimizer; choose one of {names}")
    return cls


def peak_learning_rate(spec: OptimizerSpec) -> float:
    rate = spec.learning_rate
    return rate.peak if isinstance(rate, WarmupCosineSpec) else rate


def make_optimizer(spec: OptimizerSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Weight decay only on tensors with >= 2 dims (nanoGPT); options the spec sets must be
    accepted by the chosen class."""
    cls = optimizer_class(spec.type)
    accepted = inspect.signature(cls.__init__).parameters
    options = spec.extra_kwargs()
    if spec.weight_decay:
        options["weight_decay"] = spec.weight_decay
    for option in options:
        if option not in accepted:
            raise ValueError(f"optimizer.{option} is not an option of torch.optim.{spec.type}")
    params = [p for p in model.parameters() if p.requires_grad]
    if "fused" in accepted and all(p.device.type == "cpu" and p.is_floating_point() for p in params):
        # The fused CPU kernel (Adam, AdamW, SGD, Adagrad) is bit-deterministic and, unlike the
        # default foreach path, has no slow path on the exact zeros a masked run keeps in its
        # state (bench/masked_overhead.py: 1.09x vs 1.01x of dense at 80% RigL).
        options["fused"] = True
    if "weight_decay" in options:
        groups: Any = [{"params": [p for p in params if p.dim() >= 2]},
                       {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    else:
        groups = params
    return cls(groups, lr=peak_learning_rate(spec), **options)


def lr_factor(spec: OptimizerSpec, max_steps: int) -> Callable[[int], float]:
    """LambdaLR factor for the optimizer step about to be taken (``step`` steps taken so far):
    linear warmup to the peak, cosine to the minimum at decay_steps, then constant."""
    rate = spec.learning_rate
    if not isinstance(rate, WarmupCosineSpec):
        return lambda step: 1.0
    decay_steps = rate.decay_steps or max_steps
    floor = rate.minimum / rate.peak

    def factor(step: int) -> float:
        if step < rate.warmup_steps:
            return (step + 1) / rate.warmup_steps
        if step >= decay_steps:
            return floor
        progress = (step - rate.warmup_steps) / max(1, decay_steps - rate.warmup_steps)
        return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - floor)

    return factor
