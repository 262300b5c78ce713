"""``csx preprocess``: local text files -> ModelZoo HDF5 (``training.hdf5``'s layout).

Documents (each file, every ``*.txt`` below a folder, or the plays of ``builtin:shakespeare``;
Project Gutenberg boilerplate removed)
are joined by a blank line, tokenized with UTF-8 bytes (vocab 256) or a local BPE vocabulary
file, and cut into samples of ``max_sequence_length`` tokens. Run it once per split (train,
validation) and point ``train_input`` / ``eval_input.data_dir`` at the output folders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training.text import (
    BUILTIN_SHAKESPEARE,
    ByteTokenizer,
    Tokenizer,
    encode_documents,
    make_tokenizer,
    shakespeare_dir,
    strip_gutenberg,
)
from training.hdf5 import write_hdf5


def read_documents(inputs: list[str]) -> list[str]:
    documents = []
    for item in inputs:
        path = Path(item).expanduser()
        if item == BUILTIN_SHAKESPEARE:
            files = sorted(shakespeare_dir().glob("*_gut.txt"))  # the plays training.text trains on
        else:
            files = sorted(path.rglob("*.txt")) if path.is_dir() else [path] if path.is_file() else None
        if not files:
            raise ValueError(f"--input {item!r} is neither a text file nor a folder of .txt files")
        documents += [strip_gutenberg(f.read_text(encoding="utf-8", errors="replace")) for f in files]
    return documents


def preprocess(inputs: list[str], output_dir: str, *, max_sequence_length: int,
               vocab_file: str | None = None, merges_file: str | None = None,
               samples_per_file: int = 2000) -> dict[str, Any]:
    """Write the HDF5 files; returns what ``data_params.json`` records."""
    if max_sequence_length < 1 or samples_per_file < 1:
        raise ValueError("--max_sequence_length and --samples_per_file must be >= 1")
    if merges_file and not vocab_file:
        raise ValueError("--merges_file needs --vocab_file")
    tokenizer: Tokenizer = (make_tokenizer("bpe", None, [], vocab_file, merges_file) if vocab_file
                            else ByteTokenizer())
    tokens = encode_documents(tokenizer, read_documents(inputs))
    params = {"tokenizer": "bpe" if vocab_file else "byte", "vocab_file": vocab_file,
              "merges_file": merges_file, "vocab_size": tokenizer.vocab_size, "inputs": inputs}
    return write_hdf5(tokens, Path(output_dir), seq_len=max_sequence_length,
                      samples_per_file=samples_per_file, pad_id=0, params=params)
