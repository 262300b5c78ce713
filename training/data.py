"""The data of a run, decided in one place: which reader each input section uses (ModelZoo
HDF5 or text), the shapes a plan needs without reading the data, the checks before any worker
starts, the tokenizer (the run's saved one, else a new one from the spec), and this rank's train
sampler and eval batches. The readers are training/text.py (corpora, tokenizers, token-stream
sampler) and training/hdf5.py (ModelZoo's pre-tokenized files), imported where they read: the
service sizes jobs with the decisions made from the spec alone (training.memory) and must not
import torch."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from csx_config import HDF5_PROCESSORS, InputSpec, JobSpec
from training.safe_files import read_text

if TYPE_CHECKING:
    from training.hdf5 import HDF5BatchSampler, HDF5Samples
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


def planned_vocab_size(spec: JobSpec) -> int:
    """The vocabulary the model is built with, from the spec alone: the model's for HDF5
    (pre-tokenized) data, else the tokenizer's the spec names, as text_vocab_size takes it."""
    train = spec.train_input
    if is_hdf5(train, train.data_dirs()):
        return spec.model.resolved()["vocab_size"]
    tokenizer = spec.model.tokenizer
    return text_vocab_size(spec, BYTE_VOCAB if tokenizer.type == "byte"
                           else tokenizer.vocab_size or DEFAULT_BPE_VOCAB)


def planned_shapes(spec: JobSpec) -> tuple[int, int]:
    """(vocab_size, train sequence length) without reading any data beyond HDF5 shapes:
    for plans, which must work where the data is not (yet) present. The length is the data's
    (max_sequence_length, else the HDF5 files') with the tokens the data transforms add, else
    max_position_embeddings."""
    train = spec.train_input
    seq_len = train.max_sequence_length
    if seq_len is None and is_hdf5(train, train.data_dirs()) and has_h5_files(train.data_dirs()):
        return planned_vocab_size(spec), hdf5_samples(train, train, "train_input").seq_len
    context = spec.model.resolved()["max_position_embeddings"]
    if seq_len is None:
        return planned_vocab_size(spec), context
    if seq_len + train.added_tokens() > context:
        raise ValueError(f"train_input: samples of {seq_len} tokens and {train.added_tokens()} sink tokens "
                         f"(data_transforms) exceed model.max_position_embeddings ({context})")
    return planned_vocab_size(spec), seq_len + train.added_tokens()


def eval_source(spec: JobSpec) -> InputSpec:
    """The section whose data evaluation reads: eval_input's, else train_input's."""
    return spec.eval_input if spec.eval_input.data_dirs() else spec.train_input


@dataclass
class RunData:
    vocab_size: int
    tokenizer_json: dict[str, Any]
    sampler: BatchSampler | HDF5BatchSampler
    eval_data: Any  # a list of (inputs, targets), or HDF5EvalBatches (read when iterated)


def check_data(spec: JobSpec) -> None:
    """Fail before any worker starts when a data_dir is missing or malformed (HDF5: every
    file's layout is read; text: the path must exist)."""
    for what, section, source in (("train_input", spec.train_input, spec.train_input),
                                  ("eval_input", spec.eval_input, eval_source(spec))):
        dirs = source.data_dirs()
        if is_hdf5(section, dirs):
            hdf5_samples(section, source, what)
        elif source.mixture is not None or section.data_transforms:
            raise ValueError(f"{what}: a mixture and data_transforms read ModelZoo HDF5 data, not text")
        elif len(dirs) != 1:
            raise ValueError(f"{what}.data_dir: text data takes one data_dir, got {len(dirs)} "
                             "(a list is for ModelZoo HDF5 folders)")
        elif not dirs[0].startswith("builtin:") and not Path(dirs[0]).expanduser().exists():
            raise ValueError(f"{what}.data_dir {dirs[0]!r} does not exist")


def hdf5_samples(section: InputSpec, source: InputSpec, what: str, seed: int = 0) -> Any:
    """The samples ``section`` reads from ``source``'s data (its own, or train_input's for an
    eval_input without data): its data_dir's HDF5 files or its mixture of them (interleaved,
    from ``seed``, when not shuffled, as ModelZoo), through its data transforms."""
    from training.hdf5 import HDF5Mixture, HDF5Samples, SinkTokens

    if source.mixture is not None:
        samples: Any = HDF5Mixture([HDF5Samples(entry.data_dirs(), f"{what}.mixture") for entry in source.mixture],
                                   [entry.weight for entry in source.mixture], interleave=not section.shuffle,
                                   seed=seed, what=what)
    else:
        samples = HDF5Samples(source.data_dirs(), what)
    if section.max_sequence_length not in (None, samples.seq_len):
        raise ValueError(f"{what}.max_sequence_length is {section.max_sequence_length}, but the HDF5 "
                         f"data in {source.data_dirs()} has sequences of {samples.seq_len}")
    for transform in section.data_transforms or []:
        samples = SinkTokens(samples, token_id=transform.sink_token_id, count=transform.num_sink_tokens,
                             start=transform.sink_token_start_pos,
                             truncate=transform.truncate_to_original_length, what=what)
    return samples


def load_data(spec: JobSpec, model_dir: Path | None, *, rank: int = 0, world_size: int = 1,
              save_tokenizer_file: bool = False) -> RunData:
    """This rank's train sampler and eval batches, from HDF5 or text (tokenized here)."""
    from training.hdf5 import HDF5BatchSampler, HDF5EvalBatches
    from training.text import BatchSampler, encode_documents, eval_batches, load_splits

    train, evaluation, seed = spec.train_input, spec.eval_input, spec.runconfig.seed
    shuffle_seed = seed if train.shuffle_seed is None else train.shuffle_seed
    if is_hdf5(train, train.data_dirs()):
        vocab = spec.model.resolved()["vocab_size"]
        sampler: BatchSampler | HDF5BatchSampler = HDF5BatchSampler(
            hdf5_samples(train, train, "train_input", shuffle_seed), batch_size=train.batch_size,
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
        eval_seed = seed if evaluation.shuffle_seed is None else evaluation.shuffle_seed
        eval_data: Any = HDF5EvalBatches(hdf5_samples(evaluation, eval_source(spec), "eval_input", eval_seed),
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


def load_tokenizer(spec: JobSpec, model_dir: Path | None, train_texts: list[str],
                   save: bool) -> Tokenizer:
    """The run's saved tokenizer when model_dir has one (so evaluation matches training);
    otherwise a new one from the spec, saved to model_dir when ``save``."""
    from training.text import make_tokenizer, save_tokenizer, tokenizer_from_json

    saved = model_dir / TOKENIZER_FILE if model_dir else None
    if saved and os.path.lexists(saved):  # anything there but the run's own file is refused
        return tokenizer_from_json(json.loads(read_text(saved, inside=model_dir)))
    tok = spec.model.tokenizer
    tokenizer = make_tokenizer(tok.type, tok.vocab_size, train_texts, tok.vocab_file, tok.merges_file)
    if saved and save:
        saved.parent.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tokenizer, saved)
    return tokenizer
