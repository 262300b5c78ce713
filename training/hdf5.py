"""ModelZoo's pre-tokenized HDF5 data (``GptHDF5DataProcessor`` / ``GptHDF5MapDataProcessor``).

Layout, as ModelZoo's preprocessing writes it: every ``*.h5`` file in a ``data_dir`` holds a
dataset ``data`` of shape ``[n, 3, max_sequence_length]`` (integers): per sample the
``input_ids``, the ``attention_mask`` (1 on real tokens, 0 on padding) and the ``labels`` (the
inputs shifted left by one). ``data_params.json`` beside them records how they were made.

Samples of all ``data_dir``s are numbered in (data_dir, sorted file name, row) order. Global
batch ``b`` takes positions ``[b·B, (b+1)·B)`` of an endless stream of epochs, each epoch a
permutation drawn from ``(shuffle_seed, epoch)`` when shuffling; every replica cuts its own
equal slice from that global batch, so the sharding over ``num_csx`` systems is deterministic
and a resume needs only the batch position. Labels at padding positions become -100, which
the loss ignores. A ``mixture`` of data sets (``HDF5Mixture``) and the ``add_sink_tokens``
transform (``SinkTokens``) read as ModelZoo reads them. ``write_hdf5`` produces this layout
from token streams (``csx preprocess``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from training.safe_files import RefusedFile, regular_file
from training.text import rank_slice

DATASET = "data"
PARAMS_FILE = "data_params.json"
IGNORE_INDEX = -100


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as err:
        raise ValueError("reading ModelZoo HDF5 data needs the package 'h5py' (pip install h5py)") from err
    return h5py


def h5_files(data_dirs: list[str], what: str) -> list[Path]:
    """The ``.h5`` files of each data_dir (sorted), or a ValueError naming the bad one. Each is
    a regular file inside its data_dir, given resolved: h5py opens files by name and would
    block on a FIFO or follow a link anywhere."""
    files: list[Path] = []
    for data_dir in data_dirs:
        path = Path(data_dir).expanduser()
        if not path.is_dir():
            raise ValueError(f"{what}.data_dir {data_dir!r} does not exist or is not a folder")
        found = sorted(path.glob("*.h5"))
        if not found:
            raise ValueError(f"{what}.data_dir {data_dir!r} holds no .h5 files (ModelZoo HDF5 data)")
        try:
            files.extend(regular_file(file, inside=path) for file in found)
        except RefusedFile as err:
            raise ValueError(f"{what}.data_dir {data_dir!r}: {err}") from None
    return files


class HDF5Samples:
    """Random access to the samples of several ModelZoo HDF5 files (opened lazily)."""

    def __init__(self, data_dirs: list[str], what: str) -> None:
        h5py = _h5py()
        self.files = h5_files(data_dirs, what)
        counts, lengths = [], set()
        for file in self.files:
            try:
                with h5py.File(file, "r") as handle:
                    shape = handle[DATASET].shape if DATASET in handle else None
            except OSError as err:
                raise ValueError(f"{what}: {str(file)!r} is not a readable HDF5 file ({err})") from None
            if shape is None or len(shape) != 3 or shape[1] != 3:
                raise ValueError(f"{what}: {str(file)!r} has no dataset 'data' of shape [n, 3, msl] "
                                 f"(input_ids, attention_mask, labels); found {shape}")
            counts.append(shape[0])
            lengths.add(shape[2])
        if len(lengths) != 1:
            raise ValueError(f"{what}: the .h5 files mix sequence lengths {sorted(lengths)}")
        self.seq_len = lengths.pop()
        self.offsets = np.cumsum([0, *counts])
        if self.offsets[-1] == 0:
            raise ValueError(f"{what}: the .h5 files hold no samples")
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def rows(self, indices: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of the given samples, labels -100 where the mask is 0."""
        wanted = np.asarray(list(indices), dtype=np.int64)
        files = np.searchsorted(self.offsets, wanted, side="right") - 1
        data = np.empty((len(wanted), 3, self.seq_len), dtype=np.int64)
        for file in np.unique(files):  # one sorted fancy-index read per file
            if file not in self._handles:
                self._handles[file] = _h5py().File(self.files[file], "r")
            rows = wanted[files == file] - self.offsets[file]
            unique, inverse = np.unique(rows, return_inverse=True)
            data[files == file] = self._handles[file][DATASET][unique][inverse]
        data = torch.from_numpy(data)
        inputs, mask, labels = data[:, 0], data[:, 1], data[:, 2]
        return inputs, labels.masked_fill(mask == 0, IGNORE_INDEX)


class HDF5Mixture:
    """ModelZoo's weighted mixture of HDF5 data sets (``mixture: [{data_dir, weight}, ...]``, its
    h5_map_dataset ``Mixture``), with the interface of ``HDF5Samples``. The weights are
    normalised over the sets weighing more than 0. One pass over the mixture is the number of
    samples that shows every sample of each set weighing more than 5% at least once, the
    largest len(set) / weight; set i takes int(pass · weight_i) consecutive positions, its
    position j its row j mod len(set). ``interleave`` (ModelZoo's, for unshuffled data) deals
    the positions out by a permutation drawn from ``seed`` (numpy's default_rng, as ModelZoo),
    each set's positions kept in order, so the sets are mixed and each is read in order."""

    def __init__(self, sets: list[HDF5Samples], weights: list[float], *, interleave: bool, seed: int,
                 what: str) -> None:
        kept = [(samples, weight) for samples, weight in zip(sets, weights) if weight > 0]
        if {samples.seq_len for samples, _ in kept} != {kept[0][0].seq_len}:
            raise ValueError(f"{what}.mixture: its data sets mix sequence lengths "
                             f"{sorted({samples.seq_len for samples, _ in kept})}")
        total = sum(weight for _, weight in kept)
        self.sets = [samples for samples, _ in kept]
        shares = [weight / total for _, weight in kept]
        # ModelZoo pairs the unfiltered sets with these weights here: the same unless a weight is 0.
        spans = [len(samples) / share for samples, share in zip(self.sets, shares) if share > 0.05]
        if not spans:
            raise ValueError(f"{what}.mixture: no data set weighs more than 5% of the mixture, "
                             "which ModelZoo needs to size one pass over it")
        self.seq_len = self.sets[0].seq_len
        self.boundaries = np.insert(np.cumsum([int(max(spans) * share) for share in shares]), 0, 0)
        self.order: np.ndarray | None = None
        if interleave:
            size = len(self)
            order = np.arange(size, dtype=np.min_scalar_type(size))
            np.random.default_rng(seed).shuffle(order)
            for start, end in zip(self.boundaries[:-1], self.boundaries[1:]):
                order[(start <= order) & (order < end)] = np.arange(start, end, dtype=order.dtype)
            self.order = order

    def __len__(self) -> int:
        return int(self.boundaries[-1])

    def locate(self, indices: Iterable[int]) -> tuple[np.ndarray, np.ndarray]:
        """(data set, row) of each position of the mixture."""
        positions = np.asarray(list(indices), dtype=np.int64)
        if self.order is not None:
            positions = self.order[positions].astype(np.int64)
        which = np.searchsorted(self.boundaries, positions, side="right") - 1
        lengths = np.array([len(samples) for samples in self.sets])
        return which, (positions - self.boundaries[which]) % lengths[which]

    def rows(self, indices: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        which, rows = self.locate(indices)
        inputs = torch.empty((len(rows), self.seq_len), dtype=torch.int64)
        labels = torch.empty_like(inputs)
        for index in np.unique(which):
            chosen = torch.from_numpy(np.flatnonzero(which == index))
            inputs[chosen], labels[chosen] = self.sets[index].rows(rows[which == index].tolist())
        return inputs, labels


class SinkTokens:
    """ModelZoo's ``add_sink_tokens`` transform over samples (``HDF5Samples`` or
    ``HDF5Mixture``): ``count`` tokens ``token_id`` inserted at ``start`` of every sample, with
    labels ignored by the loss there (ModelZoo's loss mask 0), the samples cut back to their
    length when ``truncate``."""

    def __init__(self, samples: Any, *, token_id: int, count: int, start: int, truncate: bool,
                 what: str) -> None:
        if start > samples.seq_len:
            raise ValueError(f"{what}.data_transforms: sink_token_start_pos {start} is past the "
                             f"sequence length {samples.seq_len}")
        self.samples, self.token_id, self.count, self.start = samples, token_id, count, start
        self.seq_len = samples.seq_len if truncate else samples.seq_len + count

    def __len__(self) -> int:
        return len(self.samples)

    def rows(self, indices: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = self.samples.rows(indices)
        sinks = torch.full((len(inputs), self.count), self.token_id, dtype=inputs.dtype)
        at = self.start
        inputs = torch.cat([inputs[:, :at], sinks, inputs[:, at:]], dim=1)[:, :self.seq_len]
        labels = torch.cat([labels[:, :at], torch.full_like(sinks, IGNORE_INDEX), labels[:, at:]], dim=1)
        return inputs, labels[:, :self.seq_len]


class HDF5BatchSampler:
    """Global batch ``position`` → this rank's (inputs, labels); same interface as
    ``training.text.BatchSampler``."""

    def __init__(self, samples: HDF5Samples, *, batch_size: int, seed: int, shuffle: bool,
                 vocab_size: int, rank: int = 0, world_size: int = 1) -> None:
        self.samples, self.batch_size, self.seed, self.shuffle = samples, batch_size, seed, shuffle
        self.seq_len, self.vocab_size = samples.seq_len, vocab_size
        self.rank_rows = rank_slice(batch_size, rank, world_size)
        self.position = 0
        self._epoch: tuple[int, torch.Tensor] | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        if self._epoch is None or self._epoch[0] != epoch:
            count = len(self.samples)
            order = (torch.randperm(count, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
                     if self.shuffle else torch.arange(count))
            self._epoch = (epoch, order)
        return self._epoch[1]

    def global_indices(self, index: int) -> list[int]:
        count = len(self.samples)
        return [int(self._order(p // count)[p % count])
                for p in range(index * self.batch_size, (index + 1) * self.batch_size)]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = self.samples.rows(self.global_indices(self.position)[self.rank_rows])
        self.position += 1
        check_vocab(inputs, self.vocab_size)
        return inputs, labels

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def check_vocab(inputs: torch.Tensor, vocab_size: int) -> None:
    if inputs.numel() and int(inputs.max()) >= vocab_size:
        raise ValueError(f"the HDF5 data holds token id {int(inputs.max())}, but model.vocab_size "
                         f"is {vocab_size}")


class HDF5EvalBatches:
    """The first ``steps`` global batches in file order (wrapping around a small eval set),
    this rank's slice of each, read when iterated: ModelZoo files ask for hundreds of eval
    steps, which a train-only run never reads."""

    def __init__(self, samples: HDF5Samples, *, batch_size: int, steps: int, vocab_size: int,
                 rank: int = 0, world_size: int = 1) -> None:
        self.samples, self.batch_size, self.steps, self.vocab_size = samples, batch_size, steps, vocab_size
        self.rows = rank_slice(batch_size, rank, world_size)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        count = len(self.samples)
        for step in range(self.steps):
            positions = range(step * self.batch_size, (step + 1) * self.batch_size)
            inputs, labels = self.samples.rows([p % count for p in positions][self.rows])
            check_vocab(inputs, self.vocab_size)
            yield inputs, labels


def write_hdf5(tokens: torch.Tensor, out_dir: Path, *, seq_len: int, samples_per_file: int,
               pad_id: int, params: dict[str, Any]) -> dict[str, Any]:
    """Cut one token stream into samples of ``seq_len`` + 1 tokens (the last one padded) and
    write them as ModelZoo HDF5 files ``data-NNNNN.h5`` plus ``data_params.json``."""
    h5py = _h5py()
    if tokens.numel() < 2:
        raise ValueError("the input holds fewer than 2 tokens")
    stream = tokens.numpy().astype(np.int64)
    count = math.ceil((len(stream) - 1) / seq_len)
    window = np.full(count * seq_len + 1, pad_id, dtype=np.int64)
    window[:len(stream)] = stream
    inputs = np.stack([window[i * seq_len:(i + 1) * seq_len] for i in range(count)])
    labels = np.stack([window[i * seq_len + 1:(i + 1) * seq_len + 1] for i in range(count)])
    mask = (np.arange(count * seq_len).reshape(count, seq_len) < len(stream) - 1).astype(np.int64)
    data = np.stack([inputs, mask, labels], axis=1).astype(np.int32)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for number, start in enumerate(range(0, count, samples_per_file)):
        path = out_dir / f"data-{number:05d}.h5"
        with h5py.File(path, "w") as handle:
            handle.create_dataset(DATASET, data=data[start:start + samples_per_file], compression="gzip")
            handle.attrs["n_examples"] = len(data[start:start + samples_per_file])
        files.append(path.name)
    summary = {**params, "max_seq_length": seq_len, "n_examples": count, "files": files,
               "tokens": int(len(stream)), "pad_id": pad_id}
    (out_dir / PARAMS_FILE).write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return summary
