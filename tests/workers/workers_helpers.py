"""Test data made as a user makes it: HDF5 folders written by `csx preprocess`."""

from __future__ import annotations

from pathlib import Path

from workers import cli


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
