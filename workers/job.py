"""Turning a ``JobSpec`` into the objects of a run: model config, data (HDF5 or text with its
tokenizer), optimizer with its LR schedule, and the sparsity algorithm. Shared by ``train`` and
``plan``."""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from workers.data import (
    BatchSampler,
    Tokenizer,
    encode_documents,
    eval_batches,
    load_splits,
    make_tokenizer,
    save_tokenizer,
    tokenizer_from_json,
)
from workers.hdf5 import HDF5BatchSampler, HDF5EvalBatches, HDF5Samples, has_h5_files
from workers.model import ModelConfig, Transformer, build_model, learning_rate_scale, lr_adjustment_scales
from workers.safe_files import read_text
from csx_config.schedulers import learning_rate_at
from csx_config import HDF5_PROCESSORS, InputSpec, JobSpec, OptimizerSpec

TOKENIZER_FILE = "tokenizer.json"
BYTE_VOCAB = 256
DEFAULT_BPE_VOCAB = 2048


def model_config(spec: JobSpec, vocab_size: int, seq_len: int) -> ModelConfig:
    """The model keys (file, else preset, else ModelZoo default) with the data's vocabulary;
    the sequences must fit the position table."""
    config = ModelConfig(**{**spec.model.resolved(), "vocab_size": vocab_size})
    if seq_len > config.max_position_embeddings:
        raise ValueError(f"the sequence length ({seq_len}) exceeds model.max_position_embeddings "
                         f"({config.max_position_embeddings})")
    return config


def is_hdf5(section: InputSpec, data_dirs: list[str]) -> bool:
    return section.data_processor in HDF5_PROCESSORS or (
        section.data_processor is None and has_h5_files(data_dirs))


def text_vocab_size(spec: JobSpec, tokenizer_vocab: int) -> int:
    """The tokenizer's vocabulary, or model.vocab_size when the file gives a larger one."""
    wanted = spec.model.vocab_size
    if wanted is not None and wanted < tokenizer_vocab:
        raise ValueError(f"model.vocab_size ({wanted}) is smaller than the tokenizer's vocabulary "
                         f"({tokenizer_vocab})")
    return wanted or tokenizer_vocab


def planned_shapes(spec: JobSpec) -> tuple[int, int]:
    """(vocab_size, train sequence length) without reading any data beyond HDF5 shapes:
    for plans, which must work where the data is not (yet) present."""
    train = spec.train_input
    if is_hdf5(train, train.data_dirs()):
        seq_len = train.max_sequence_length
        if seq_len is None and has_h5_files(train.data_dirs()):
            seq_len = HDF5Samples(train.data_dirs(), "train_input").seq_len
        vocab = spec.model.resolved()["vocab_size"]
    else:
        seq_len = train.max_sequence_length
        tokenizer = spec.model.tokenizer
        vocab = text_vocab_size(spec, BYTE_VOCAB if tokenizer.type == "byte"
                                else tokenizer.vocab_size or DEFAULT_BPE_VOCAB)
    return vocab, seq_len or spec.model.resolved()["max_position_embeddings"]


@dataclass
class RunData:
    vocab_size: int
    tokenizer_json: dict[str, Any]
    sampler: BatchSampler | HDF5BatchSampler
    eval_data: Any  # a list of (inputs, targets), or HDF5EvalBatches (read when iterated)


def check_data(spec: JobSpec) -> None:
    """Fail before any worker starts when a data_dir is missing or malformed (HDF5: every
    file's layout is read; text: the path must exist)."""
    for what, section, dirs in (("train_input", spec.train_input, spec.train_input.data_dirs()),
                                ("eval_input", spec.eval_input, spec.eval_data_dirs())):
        if is_hdf5(section, dirs):
            _hdf5_samples(section, dirs, what)
        elif len(dirs) != 1:
            raise ValueError(f"{what}.data_dir: text data takes one data_dir, got {len(dirs)} "
                             "(a list is for ModelZoo HDF5 folders)")
        elif not dirs[0].startswith("builtin:") and not Path(dirs[0]).expanduser().exists():
            raise ValueError(f"{what}.data_dir {dirs[0]!r} does not exist")


def _hdf5_samples(section: InputSpec, dirs: list[str], what: str) -> HDF5Samples:
    samples = HDF5Samples(dirs, what)
    if section.max_sequence_length not in (None, samples.seq_len):
        raise ValueError(f"{what}.max_sequence_length is {section.max_sequence_length}, but the HDF5 "
                         f"data in {dirs} has sequences of {samples.seq_len}")
    return samples


def load_data(spec: JobSpec, model_dir: Path | None, *, rank: int = 0, world_size: int = 1,
              save_tokenizer_file: bool = False) -> RunData:
    """This rank's train sampler and eval batches, from HDF5 or text (tokenized here)."""
    train, evaluation, seed = spec.train_input, spec.eval_input, spec.runconfig.seed
    shuffle_seed = seed if train.shuffle_seed is None else train.shuffle_seed
    if is_hdf5(train, train.data_dirs()):
        vocab = spec.model.resolved()["vocab_size"]
        sampler: BatchSampler | HDF5BatchSampler = HDF5BatchSampler(
            _hdf5_samples(train, train.data_dirs(), "train_input"), batch_size=train.batch_size,
            seed=shuffle_seed, shuffle=train.shuffle, vocab_size=vocab, rank=rank, world_size=world_size)
        tokenizer_json = {"type": "pretokenized", "vocab_size": vocab}
        tokenizer, train_splits = None, None
    else:
        splits = load_splits(_one_text_dir(train.data_dirs(), "train_input"))
        tokenizer = load_tokenizer(spec, model_dir, splits.train, save_tokenizer_file)
        vocab = text_vocab_size(spec, tokenizer.vocab_size)
        seq_len = train.max_sequence_length or spec.model.resolved()["max_position_embeddings"]
        sampler = BatchSampler(encode_documents(tokenizer, splits.train), batch_size=train.batch_size,
                               seq_len=seq_len, seed=shuffle_seed, shuffle=train.shuffle, rank=rank,
                               world_size=world_size)
        tokenizer_json, train_splits = tokenizer.to_json(), splits
    eval_dirs = spec.eval_data_dirs()
    steps = spec.runconfig.eval_steps
    if is_hdf5(evaluation, eval_dirs):
        eval_data: Any = HDF5EvalBatches(_hdf5_samples(evaluation, eval_dirs, "eval_input"),
                                         batch_size=evaluation.batch_size, steps=steps, vocab_size=vocab,
                                         rank=rank, world_size=world_size)
    else:
        if tokenizer is None:
            raise ValueError("eval_input: text data needs a tokenizer, but train_input is HDF5 "
                             "(pre-tokenized); give eval_input an HDF5 data_dir")
        eval_dir = _one_text_dir(eval_dirs, "eval_input")
        eval_splits = train_splits if eval_dirs == train.data_dirs() else load_splits(eval_dir)
        eval_data = eval_batches(encode_documents(tokenizer, eval_splits.validation),
                                 batch_size=evaluation.batch_size,
                                 seq_len=evaluation.max_sequence_length or sampler.seq_len, steps=steps,
                                 rank=rank, world_size=world_size)
    return RunData(vocab_size=vocab, tokenizer_json=tokenizer_json, sampler=sampler, eval_data=eval_data)


def _one_text_dir(dirs: list[str], what: str) -> str:
    if len(dirs) != 1:
        raise ValueError(f"{what}.data_dir: text data takes one data_dir, got {len(dirs)}")
    return dirs[0]


def build_sparse_model(spec: JobSpec, config: ModelConfig, device: str | None = None
                       ) -> tuple[Transformer, Any]:
    """The model (seeded by runconfig.seed; shapes only on ``device="meta"``) and, when the
    spec has a sparsity section, the configured algorithm applied to it (masks exist on return)."""
    model = build_model(config, seed=spec.runconfig.seed, device=device)
    if spec.sparsity is None:
        return model, None
    import sparsity

    # runconfig.seed seeds the masks too, unless the sparsity config names its own seed.
    section = _with_defaults(spec.sparsity, {"seed": spec.runconfig.seed})
    algorithm = sparsity.configure(section)  # checks the section as written
    if device == "meta":
        # A meta tensor has no values to draw a mask from: all-True masks of the right shape;
        # plans read the per-layer targets, never the masks.
        algorithm = sparsity.configure(_with_defaults(section, {"init_method": _shape_only_mask}, override=True))
    algorithm.apply(model)
    return model, algorithm


def _shape_only_mask(param: torch.Tensor, _sparsity: float, _generator: torch.Generator) -> torch.Tensor:
    return torch.ones_like(param, dtype=torch.bool)


def _with_defaults(config: Any, defaults: dict[str, Any], override: bool = False) -> Any:
    """The sparsity section with ``defaults`` in every group (the section's own values win
    unless ``override``)."""
    if isinstance(config, (int, float)):
        return {"sparsity": config, **defaults}
    if isinstance(config, list):
        return [_with_defaults(group, defaults, override) if isinstance(group, dict) else group
                for group in config]
    return {**config, **defaults} if override else {**defaults, **config}


def load_tokenizer(spec: JobSpec, model_dir: Path | None, train_texts: list[str],
                   save: bool) -> Tokenizer:
    """The run's saved tokenizer when model_dir has one (so evaluation matches training);
    otherwise a new one from the spec, saved to model_dir when ``save``."""
    saved = model_dir / TOKENIZER_FILE if model_dir else None
    if saved and os.path.lexists(saved):  # anything there but the run's own file is refused
        return tokenizer_from_json(json.loads(read_text(saved, inside=model_dir)))
    tok = spec.model.tokenizer
    tokenizer = make_tokenizer(tok.type, tok.vocab_size, train_texts, tok.vocab_file, tok.merges_file)
    if saved and save:
        saved.parent.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tokenizer, saved)
    return tokenizer


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The torch.optim class ModelZoo's ``optimizer_type`` names (any case: AdamW, adamw, SGD)."""
    classes = {n.lower(): c for n, c in vars(torch.optim).items()
               if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    if name.lower() not in classes:
        raise ValueError(f"optimizer.optimizer_type {name!r} is not a torch.optim optimizer; choose one of "
                         f"{sorted(c.__name__ for c in classes.values())}")
    return classes[name.lower()]


def make_optimizer(spec: OptimizerSpec, model: torch.nn.Module,
                   adjust_learning_rate: dict[str, float] | None = None) -> torch.optim.Optimizer:
    """Weight decay only on tensors with >= 2 dims (nanoGPT); options the spec sets must be
    accepted by the chosen class. The learning rate is 1.0 here, times each parameter's muP /
    ``adjust_learning_rate`` factor (``workers.model.lr_adjustment_scales``): ``lr_lambda``
    gives the absolute rate of every step."""
    cls = optimizer_class(spec.optimizer_type)
    accepted = inspect.signature(cls.__init__).parameters
    options = spec.extra_kwargs()
    if spec.weight_decay:
        options["weight_decay"] = spec.weight_decay
    for option in options:
        if option not in accepted:
            raise ValueError(f"optimizer.{option} is not an option of torch.optim.{cls.__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    if "fused" in accepted and all(p.device.type == "cpu" and p.is_floating_point() for p in params):
        # The fused CPU kernel (Adam, AdamW, SGD, Adagrad) is bit-deterministic and, unlike the
        # default foreach path, has no slow path on the exact zeros a masked run keeps in its
        # state (bench/masked_overhead.py: 1.09x vs 1.01x of dense at 80% RigL).
        options["fused"] = True
    if "weight_decay" in options:
        groups: list[dict[str, Any]] = [{"params": [p for p in params if p.dim() >= 2]},
                                        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    else:
        groups = [{"params": params}]
    return cls(_with_lr_scales(groups, model, adjust_learning_rate), lr=1.0, **options)


def _with_lr_scales(groups: list[dict[str, Any]], model: torch.nn.Module,
                    adjust: dict[str, float] | None) -> list[dict[str, Any]]:
    """``groups`` with the parameters whose learning rate is scaled moved into groups of their
    own whose base rate is the scale (LambdaLR multiplies it by the schedule's rate).
    Unscaled parameters keep the first groups, so param_groups[0] has the schedule's rate."""
    config = getattr(model, "built", None)
    if config is None:
        return groups
    scales = lr_adjustment_scales(config, adjust)
    names = {id(p): name for name, p in model.named_parameters()}
    scaled: list[dict[str, Any]] = []
    for group in groups:
        by_scale: dict[float, list[torch.nn.Parameter]] = {}
        for p in group["params"]:
            by_scale.setdefault(learning_rate_scale(scales, names[id(p)]), []).append(p)
        group["params"] = by_scale.pop(1.0, [])
        scaled += [{**group, "params": ps, "lr": scale} for scale, ps in by_scale.items()]
    return groups + scaled


def lr_lambda(spec: OptimizerSpec) -> Callable[[int], float]:
    """LambdaLR function (base rate 1.0) for the step about to be taken (``step`` steps taken
    so far): ModelZoo's ``learning_rate``, a number or a scheduler sequence."""
    rate = spec.learning_rate
    return lambda step: learning_rate_at(rate, step)
