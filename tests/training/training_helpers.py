"""Test data made as a user makes it (HDF5 folders written by `csx preprocess`), equality of
saved training states, and a memory cap for code that might read an endless file."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from csx import cli


@contextmanager
def memory_headroom(extra_bytes: int) -> Iterator[None]:
    """Caps this process's address space at its current size + extra_bytes, so code that
    reads an endless file fails with MemoryError instead of exhausting the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as status:
        size_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size_kb * 1024 + extra_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def same_state(a: Any, b: Any) -> bool:
    """Deep equality for nested dicts/lists holding tensors."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b or (a != a and b != b)  # NaN == NaN here


def preprocess_texts(root: Path, texts: dict[str, str], max_sequence_length: int,
                     *extra_args: str) -> Path:
    """For each name → text: `root/<name>.txt`, then `csx preprocess` into the folder
    `root/<name>` (ModelZoo's HDF5 layout, byte tokenizer). Returns `root`."""
    for name, text in texts.items():
        (root / f"{name}.txt").write_text(text)
        assert cli.main(["preprocess", "--input", str(root / f"{name}.txt"), "--output_dir",
                         str(root / name), "--max_sequence_length", str(max_sequence_length),
                         *extra_args]) == 0
    return root
