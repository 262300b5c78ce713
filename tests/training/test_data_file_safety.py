"""Data folders read only their own regular files (issue 32, item 8): a FIFO named *.txt is
refused at once instead of blocking the job until its timeout, a *.txt link to /dev/zero or
to a file outside the folder is refused instead of read, and the same holds for HDF5 files."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from csx_config import JobSpec
from training.text import load_splits
from training.hdf5 import h5_files
from training.data import TOKENIZER_FILE, load_tokenizer
from training.safe_files import RefusedFile
from training_helpers import memory_headroom

DEADLINE_S = 60  # far beyond a refusal's milliseconds; the old code blocked until the job timeout


def _corpus(folder: Path) -> Path:
    folder.mkdir()
    for name in ("a", "b", "c"):
        (folder / f"{name}.txt").write_text(f"the text of {name}\n" * 20)
    return folder


def _within_deadline(call):
    """call()'s result or exception, run in a thread; fails if it is still blocked at the
    deadline (the thread is left behind, as a blocked open cannot be interrupted)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as err:  # handed to the test thread
            outcome["error"] = err

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(DEADLINE_S)
    assert not worker.is_alive(), f"still blocked after {DEADLINE_S} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_a_fifo_named_txt_is_refused_at_once(tmp_path):
    folder = _corpus(tmp_path / "corpus")
    fifo = folder / "stream.txt"
    os.mkfifo(fifo)
    try:
        with pytest.raises(RefusedFile, match=r"stream\.txt' is a named pipe \(FIFO\)"):
            _within_deadline(lambda: load_splits(str(folder)))
    finally:  # a reader the old code left blocked sees end-of-file and returns
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # nobody is reading: nothing was blocked


@pytest.mark.parametrize("target", ["/dev/null", "/dev/zero"])
def test_a_txt_link_to_a_device_is_refused(tmp_path, target):
    folder = _corpus(tmp_path / "corpus")
    (folder / "endless.txt").symlink_to(target)
    with memory_headroom(1 << 30), pytest.raises(RefusedFile, match=r"endless\.txt' links out"):
        _within_deadline(lambda: load_splits(str(folder)))


def test_a_txt_link_out_of_the_folder_is_refused_but_links_inside_are_read(tmp_path):
    folder = _corpus(tmp_path / "corpus")
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of the corpus\n")
    (folder / "d.txt").symlink_to(folder / "a.txt")  # stays inside: fine
    assert len(load_splits(str(folder)).train) + len(load_splits(str(folder)).validation) == 4
    (folder / "e.txt").symlink_to(secret)
    with pytest.raises(RefusedFile, match=r"e\.txt' links out of its folder"):
        load_splits(str(folder))


def test_a_single_file_data_dir_must_be_a_regular_file(tmp_path):
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    with pytest.raises(RefusedFile, match="named pipe"):
        _within_deadline(lambda: load_splits(str(fifo)))
    link = tmp_path / "zero.txt"
    link.symlink_to("/dev/zero")
    with memory_headroom(1 << 30), pytest.raises(RefusedFile, match="character device"):
        _within_deadline(lambda: load_splits(str(link)))


def test_hdf5_files_must_be_regular_files_inside_the_folder(tmp_path):
    folder = tmp_path / "h5"
    folder.mkdir()
    (folder / "data-00000.h5").write_bytes(b"")
    assert h5_files([str(folder)], "train_input") == [(folder / "data-00000.h5").resolve()]
    os.mkfifo(folder / "data-00001.h5")
    with pytest.raises(ValueError, match=r"train_input.data_dir .*data-00001\.h5' is a named pipe"):
        _within_deadline(lambda: h5_files([str(folder)], "train_input"))
    (folder / "data-00001.h5").unlink()
    (folder / "data-00001.h5").symlink_to(tmp_path / "elsewhere.h5")
    with pytest.raises(ValueError, match=r"data-00001\.h5' links out of its folder"):
        h5_files([str(folder)], "train_input")


def test_a_planted_tokenizer_file_in_the_model_dir_is_refused(tmp_path):
    """A resume reads the run's tokenizer.json back; a FIFO there used to make the run train a
    new tokenizer and block writing it, a link out of the model_dir was read."""
    spec = JobSpec.from_yaml("train_input: {batch_size: 4}\nmodel: {preset: tiny}\n")
    planted = tmp_path / TOKENIZER_FILE
    os.mkfifo(planted)
    try:
        with pytest.raises(RefusedFile, match=r"tokenizer\.json' is a named pipe"):
            _within_deadline(lambda: load_tokenizer(spec.model.tokenizer, tmp_path, ["some text"], save=True))
    finally:  # a writer the old code left blocked gets a reader and returns
        try:
            os.close(os.open(planted, os.O_RDONLY | os.O_NONBLOCK))
        except OSError:
            pass
    planted.unlink()
    planted.symlink_to(tmp_path.parent / "someone-elses-tokenizer.json")
    with pytest.raises(RefusedFile, match="links out of its folder"):
        load_tokenizer(spec.model.tokenizer, tmp_path, ["some text"], save=True)
