"""The data of a run, decided in one place: which reader each input section uses (ModelZoo
HDF5 or text), the shapes a plan needs without reading the data, the checks before any worker
starts, the tokenizer (the run's saved one, else a new one as the plan says), and this rank's
train sampler and eval batches. The readers are training/text.py (corpora, tokenizers,
token-stream sampler) and training/hdf5.py (ModelZoo's pre-tokenized files), imported where they
read: the service sizes jobs with the decisions made from the spec alone (training.memory) and
must not import torch."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from csx_config import HDF5_PROCESSORS, InputSpec, JobSpec, TokenizerSpec
from csx_config.inputs import SinkTokensSpec
from training.safe_files import read_text

if TYPE_CHECKING:
    from training.hdf5 import HDF5BatchSampler
    from training.text import BatchSampler, Tokenizer

TOKENIZER_FILE = "tokenizer.json"
BYTE_VOCAB = 256
DEFAULT_BPE_VOCAB = 2048


def has_h5_files(data_dirs: list[str]) -> bool:
    """Whether any data_dir is a folder holding .h5 files (one that cannot be read holds none
    that training could read)."""
    try:
        return any(Path(d).expanduser().is_dir() and any(Path(d).expanduser().glob("*.h5"))
                   for d in data_dirs if not d.startswith("builtin:"))
    except OSError:
        return False


def is_hdf5(section: InputSpec | InputPlan, data_dirs: list[str] | tuple[str, ...]) -> bool:
    return section.data_processor in HDF5_PROCESSORS or (
        section.data_processor is None and has_h5_files(data_dirs))


def text_vocab_size(wanted: int | None, tokenizer_vocab: int) -> int:
    """The tokenizer's vocabulary, or model.vocab_size (`wanted`) when the file gives a larger one."""
    if wanted is not None and wanted < tokenizer_vocab:
        raise ValueError(f"model.vocab_size ({wanted}) is smaller than the tokenizer's vocabulary "
                         f"({tokenizer_vocab})")
    return wanted or tokenizer_vocab


def planned_vocab_size(spec: JobSpec) -> int:
    """The vocabulary the model is built with, from the spec alone: the model's for HDF5
    (pre-tokenized) data, else the tokenizer's the spec names, as text_vocab_size takes it."""
    train = spec.train_input
    if is_hdf5(train, train.data_dirs()):
        return spec.model.resolved()["vocab_size"]
    tokenizer = spec.model.tokenizer
    return text_vocab_size(spec.model.vocab_size, BYTE_VOCAB if tokenizer.type == "byte"
                           else tokenizer.vocab_size or DEFAULT_BPE_VOCAB)


def planned_shapes(spec: JobSpec) -> tuple[int, int]:
    """(vocab_size, train sequence length) without reading any data beyond HDF5 shapes:
    for plans, which must work where the data is not (yet) present. The length is the data's
    (max_sequence_length, else the HDF5 files') with the tokens the data transforms add, else
    max_position_embeddings."""
    train = spec.train_input
    seq_len = train.max_sequence_length
    if seq_len is None and is_hdf5(train, train.data_dirs()) and has_h5_files(train.data_dirs()):
        return planned_vocab_size(spec), hdf5_samples(input_plan(train, train, spec.runconfig.seed)).seq_len
    if seq_len is None:
        return planned_vocab_size(spec), spec.model.resolved()["max_position_embeddings"]
    return planned_vocab_size(spec), seq_len + train.added_tokens()


def eval_source(spec: JobSpec) -> InputSpec:
    """The section whose data evaluation reads: eval_input's, else train_input's."""
    return spec.eval_input if spec.eval_input.data_dirs() else spec.train_input


def input_plan(section: InputSpec, source: InputSpec, seed: int) -> InputPlan:
    """`section` as the loader reads it, with the data of `source` (itself, or train_input for
    an eval_input without data); `seed` is runconfig's, for a section that gives none."""
    mixture = None if source.mixture is None else tuple(
        (tuple(entry.data_dirs()), entry.weight) for entry in source.mixture)
    return InputPlan(section=section.SECTION, data_processor=section.data_processor,
                     data_dirs=tuple(source.data_dirs()), mixture=mixture,
                     data_transforms=tuple(section.data_transforms or ()), batch_size=section.batch_size,
                     max_sequence_length=section.max_sequence_length, shuffle=section.shuffle,
                     shuffle_seed=seed if section.shuffle_seed is None else section.shuffle_seed)


@dataclass(frozen=True)
class InputPlan:
    """One input section as the data loader reads it."""

    section: str  # "train_input" or "eval_input", for messages
    data_processor: str | None  # None: HDF5 when the folders hold .h5 files, else text
    data_dirs: tuple[str, ...]  # every folder it reads (a mixture's too)
    mixture: tuple[tuple[tuple[str, ...], float], ...] | None  # (folders, weight) per data set
    data_transforms: tuple[SinkTokensSpec, ...]
    batch_size: int  # global, split evenly over the systems
    max_sequence_length: int | None
    shuffle: bool
    shuffle_seed: int


@dataclass(frozen=True)
class DataPlan:
    """The job's data: its inputs, how many eval batches, the tokenizer of text data, and the
    model's vocabulary and positions the data must fit."""

    train: InputPlan
    eval: InputPlan
    eval_steps: int
    tokenizer: TokenizerSpec
    requested_vocab_size: int | None  # model.vocab_size as the file gives it (text: None is the tokenizer's)
    model_vocab_size: int  # the resolved model's (HDF5 data is tokenized for it)
    max_position_embeddings: int  # a text run without max_sequence_length trains at this length
    seq_len: int  # as planned: max_sequence_length, else the HDF5 data's (when there), else the above


@dataclass
class RunData:
    vocab_size: int
    tokenizer_json: dict[str, Any]
    sampler: BatchSampler | HDF5BatchSampler
    eval_data: Any  # a list of (inputs, targets), or HDF5EvalBatches (read when iterated)


def check_data(data: DataPlan) -> None:
    """Fail before any worker starts when a data_dir is missing or malformed (HDF5: every
    file's layout is read; text: the path must exist)."""
    for section in (data.train, data.eval):
        dirs = list(section.data_dirs)
        if is_hdf5(section, dirs):
            hdf5_samples(section)
        elif section.mixture is not None or section.data_transforms:
            raise ValueError(f"{section.section}: a mixture and data_transforms read ModelZoo HDF5 data, not text")
        elif len(dirs) != 1:
            raise ValueError(f"{section.section}.data_dir: text data takes one data_dir, got {len(dirs)} "
                             "(a list is for ModelZoo HDF5 folders)")
        elif not dirs[0].startswith("builtin:") and not Path(dirs[0]).expanduser().exists():
            raise ValueError(f"{section.section}.data_dir {dirs[0]!r} does not exist")


def hdf5_samples(section: InputPlan) -> Any:
    """The samples `section` reads: its HDF5 folders' or its mixture of them (interleaved from
    its shuffle seed when not shuffled, as ModelZoo), through its data transforms."""
    from training.hdf5 import HDF5Mixture, HDF5Samples, SinkTokens

    what = section.section

    if section.mixture is not None:
        samples: Any = HDF5Mixture([HDF5Samples(list(dirs), f"{what}.mixture") for dirs, _ in section.mixture],
                                   [weight for _, weight in section.mixture], interleave=not section.shuffle,
                                   seed=section.shuffle_seed, what=what)
    else:
        samples = HDF5Samples(list(section.data_dirs), what)
    if section.max_sequence_length not in (None, samples.seq_len):
        raise ValueError(f"{what}.max_sequence_length is {section.max_sequence_length}, but the HDF5 "
                         f"data in {list(section.data_dirs)} has sequences of {samples.seq_len}")
    for transform in section.data_transforms:
        samples = SinkTokens(samples, token_id=transform.sink_token_id, count=transform.num_sink_tokens,
                             start=transform.sink_token_start_pos,
                             truncate=transform.truncate_to_original_length, what=what)
    return samples


def load_data(data: DataPlan, model_dir: Path | None, *, rank: int = 0, world_size: int = 1,
              save_tokenizer_file: bool = False) -> RunData:
    """This rank's train sampler and eval batches, from HDF5 or text (tokenized here)."""
    from training.hdf5 import HDF5BatchSampler, HDF5EvalBatches
    from training.text import BatchSampler, encode_documents, eval_batches, load_splits

    train, evaluation = data.train, data.eval
    train_dirs, eval_dirs = list(train.data_dirs), list(evaluation.data_dirs)
    if is_hdf5(train, train_dirs):
        vocab = data.model_vocab_size
        sampler: BatchSampler | HDF5BatchSampler = HDF5BatchSampler(
            hdf5_samples(train), batch_size=train.batch_size,
            seed=train.shuffle_seed, shuffle=train.shuffle, vocab_size=vocab, rank=rank, world_size=world_size)
        tokenizer_json = {"type": "pretokenized", "vocab_size": vocab}
        tokenizer, train_splits = None, None
    else:
        splits = load_splits(_one_text_dir(train_dirs, "train_input"))
        tokenizer = load_tokenizer(data.tokenizer, model_dir, splits.train, save_tokenizer_file)
        vocab = text_vocab_size(data.requested_vocab_size, tokenizer.vocab_size)
        seq_len = train.max_sequence_length or data.max_position_embeddings
        sampler = BatchSampler(encode_documents(tokenizer, splits.train), batch_size=train.batch_size,
                               seq_len=seq_len, seed=train.shuffle_seed, shuffle=train.shuffle, rank=rank,
                               world_size=world_size)
        tokenizer_json, train_splits = tokenizer.to_json(), splits
    steps = data.eval_steps
    if is_hdf5(evaluation, eval_dirs):
        eval_data: Any = HDF5EvalBatches(hdf5_samples(evaluation),
                                         batch_size=evaluation.batch_size, steps=steps, vocab_size=vocab,
                                         rank=rank, world_size=world_size)
    else:
        if tokenizer is None:
            raise ValueError("eval_input: text data needs a tokenizer, but train_input is HDF5 "
                             "(pre-tokenized); give eval_input an HDF5 data_dir")
        eval_dir = _one_text_dir(eval_dirs, "eval_input")
        eval_splits = train_splits if eval_dirs == train_dirs else load_splits(eval_dir)
        eval_data = eval_batches(encode_documents(tokenizer, eval_splits.validation),
                                 batch_size=evaluation.batch_size,
                                 seq_len=evaluation.max_sequence_length or sampler.seq_len, steps=steps,
                                 rank=rank, world_size=world_size)
    return RunData(vocab_size=vocab, tokenizer_json=tokenizer_json, sampler=sampler, eval_data=eval_data)


def _one_text_dir(dirs: list[str], what: str) -> str:
    if len(dirs) != 1:
        raise ValueError(f"{what}.data_dir: text data takes one data_dir, got {len(dirs)}")
    return dirs[0]


def load_tokenizer(tok: TokenizerSpec, model_dir: Path | None, train_texts: list[str],
                   save: bool) -> Tokenizer:
    """The run's saved tokenizer when model_dir has one (so evaluation matches training);
    otherwise a new one as `tok` says, saved to model_dir when ``save``."""
    from training.text import make_tokenizer, save_tokenizer, tokenizer_from_json

    saved = model_dir / TOKENIZER_FILE if model_dir else None
    if saved and os.path.lexists(saved):  # anything there but the run's own file is refused
        return tokenizer_from_json(json.loads(read_text(saved, inside=model_dir)))
    tokenizer = make_tokenizer(tok.type, tok.vocab_size, train_texts, tok.vocab_file, tok.merges_file)
    if saved and save:
        saved.parent.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tokenizer, saved)
    return tokenizer
