"""Damaged checkpoints and full disks (issue 32, items 7 and 9): a checkpoint truncated,
emptied, overwritten or with one flipped bit is refused with a reason naming it; a resume falls
back to the newest checkpoint that loads and continues bit-identically; with every checkpoint
damaged the reason names each; a full disk is reported as ENOSPC, not as torch's
"unexpected pos"."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from csx_config import JobSpec
from training import checkpoint as ckpt
from training.loop import SKIPPED_CHECKPOINT, train
from training_helpers import same_state
from training.plan import plan_job

torch.set_num_threads(1)


def _flip_one_bit(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1:]


DAMAGE = {
    "truncated": lambda data: data[:len(data) // 2],
    "empty": lambda data: b"",
    "overwritten": lambda data: bytes(range(256)) * (len(data) // 256 + 1),
    "one flipped bit": _flip_one_bit,
}


def _damage(path: Path, how: str) -> None:
    path.write_bytes(DAMAGE[how](path.read_bytes()))


def _save_steps(model_dir: Path, steps: list[int]) -> None:
    for step in steps:
        weights = torch.arange(4096, dtype=torch.float32) * step
        ckpt.save_checkpoint({"model": {"w": weights}, "step": step}, ckpt.checkpoint_path(model_dir, step))


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, caplog, how):
    _save_steps(tmp_path, [1, 2, 3])
    _damage(ckpt.checkpoint_path(tmp_path, 3), how)
    with caplog.at_level(logging.WARNING, logger="csx"):
        path, state, skipped = ckpt.newest_valid_checkpoint(tmp_path)
    assert path == ckpt.checkpoint_path(tmp_path, 2) and state["step"] == 2
    assert torch.equal(state["model"]["w"], torch.arange(4096, dtype=torch.float32) * 2)
    assert len(skipped) == 1 and "checkpoint_3.mdl" in skipped[0]
    assert any("checkpoint_3.mdl" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("how", ["truncated", "empty", "overwritten"])
def test_damage_is_found_without_the_recorded_digest_too(tmp_path, how):
    """A checkpoint copied without its .sha256 (or written before them) still gets a reason
    naming the file, not torch's bare EOFError."""
    _save_steps(tmp_path, [5])
    path = ckpt.checkpoint_path(tmp_path, 5)
    ckpt.digest_path(path).unlink()
    _damage(path, how)
    with pytest.raises(ckpt.CorruptCheckpoint, match="checkpoint_5.mdl") as refused:
        ckpt.load_checkpoint(path)
    assert len(str(refused.value).splitlines()) == 1  # a job's reason is one line


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, bytes]:
    folder = tmp_path_factory.mktemp("written")
    _save_steps(folder, [1])
    return folder, ckpt.checkpoint_path(folder, 1).read_bytes()


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0, 1, exclude_max=True), flip=st.floats(0, 1, exclude_max=True),
       bit=st.integers(0, 7), keep_digest=st.booleans())
def test_any_truncation_or_flipped_bit_is_refused_as_corrupt(tmp_path, written, cut, flip, bit,
                                                             keep_digest):
    """Wherever a checkpoint is cut, the reason is CorruptCheckpoint naming it (with or without
    its digest); wherever one bit flips, the digest catches it."""
    _, data = written
    path = tmp_path / "checkpoint_1.mdl"
    digest = ckpt.digest_path(path)
    path.write_bytes(data[:int(cut * len(data))])
    if keep_digest:
        shutil.copy(ckpt.digest_path(written[0] / path.name), digest)
    else:
        digest.unlink(missing_ok=True)
    with pytest.raises(ckpt.CorruptCheckpoint, match="checkpoint_1.mdl"):
        ckpt.load_checkpoint(path)
    at = int(flip * len(data))
    path.write_bytes(data[:at] + bytes([data[at] ^ (1 << bit)]) + data[at + 1:])
    shutil.copy(ckpt.digest_path(written[0] / path.name), digest)
    with pytest.raises(ckpt.CorruptCheckpoint, match="does not match the sha256"):
        ckpt.load_checkpoint(path)


def test_an_empty_checkpoint_says_so(tmp_path):
    _save_steps(tmp_path, [7])
    _damage(ckpt.checkpoint_path(tmp_path, 7), "empty")
    with pytest.raises(ckpt.CorruptCheckpoint, match=r"checkpoint_7.mdl' is empty \(0 bytes\)"):
        ckpt.load_checkpoint(ckpt.checkpoint_path(tmp_path, 7))


def test_every_checkpoint_damaged_is_an_error_naming_each(tmp_path):
    _save_steps(tmp_path, [1, 2])
    for step, how in ((1, "truncated"), (2, "one flipped bit")):
        _damage(ckpt.checkpoint_path(tmp_path, step), how)
    with pytest.raises(ckpt.CorruptCheckpoint, match="2 tried") as refused:
        ckpt.newest_valid_checkpoint(tmp_path)
    assert "checkpoint_1.mdl" in str(refused.value) and "checkpoint_2.mdl" in str(refused.value)


def test_a_checkpoint_without_a_digest_loads(tmp_path):
    path = ckpt.checkpoint_path(tmp_path, 4)
    torch.save({"model": {"w": torch.ones(3)}, "step": 4}, path)
    assert ckpt.newest_valid_checkpoint(tmp_path)[1]["step"] == 4


def test_the_digest_is_sha256sum_format(tmp_path):
    import hashlib

    _save_steps(tmp_path, [9])
    path = ckpt.checkpoint_path(tmp_path, 9)
    assert ckpt.digest_path(path).read_text() == (
        f"{hashlib.sha256(path.read_bytes()).hexdigest()}  checkpoint_9.mdl\n")


def test_a_full_disk_names_ENOSPC_and_the_checkpoint(tmp_path, monkeypatch):
    """Writes to /dev/full fail with a real ENOSPC; torch.save turns that into "unexpected
    pos" unless the checkpoint writer keeps the cause."""
    real_mkstemp = tempfile.mkstemp
    made = []

    def onto_a_full_disk(**kwargs):
        handle, name = real_mkstemp(**kwargs)
        made.append(name)
        os.dup2(os.open("/dev/full", os.O_WRONLY), handle)
        return handle, name

    monkeypatch.setattr(ckpt.tempfile, "mkstemp", onto_a_full_disk)
    path = ckpt.checkpoint_path(tmp_path, 20)
    with pytest.raises(OSError) as failed:
        ckpt.save_checkpoint({"model": {"w": torch.zeros(100_000)}, "step": 20}, path)
    assert failed.value.errno == errno.ENOSPC
    assert str(failed.value) == (f"[Errno 28] No space left on device (ENOSPC) writing "
                                 f"checkpoint {path}")
    assert made and os.listdir(tmp_path) == []  # the temporary file is gone, nothing renamed


SPEC = """
train_input: {batch_size: 4, max_sequence_length: 16}
eval_input: {batch_size: 4, max_sequence_length: 16}
model: {preset: tiny}
optimizer: {optimizer_type: AdamW, learning_rate: 1.0e-3}
sparsity: {algorithm: rigl, sparsity: 0.75, update: {freq: 2}, drop_fraction: 0.3}
runconfig: {max_steps: 6, checkpoint_steps: 2, log_steps: 2, eval_steps: 1, seed: 0, mlflow_experiment: "", sparse_kernel: dense}
"""


def test_a_resume_past_a_damaged_checkpoint_continues_bit_identically(tmp_path):
    """Steps 1-6 straight through; then the same run with checkpoint_6 truncated and
    checkpoint_4 flipped resumes from checkpoint_2 and rewrites both exactly."""
    reference_dir, resumed_dir = tmp_path / "reference", tmp_path / "resumed"
    spec = JobSpec.from_yaml(SPEC)
    reference = train(plan_job(spec), model_dir=str(reference_dir))
    shutil.copytree(reference_dir, resumed_dir)
    _damage(ckpt.checkpoint_path(resumed_dir, 6), "truncated")
    _damage(ckpt.checkpoint_path(resumed_dir, 4), "one flipped bit")
    events: list[dict] = []
    resumed = train(plan_job(spec), model_dir=str(resumed_dir), progress=events.append)
    # The warnings reach the job's log (through progress), not only the worker's stderr.
    skipped = [e["reason"] for e in events if e.get("event") == SKIPPED_CHECKPOINT]
    assert skipped == resumed["skipped_checkpoints"] and len(skipped) == 2
    assert events.index(next(e for e in events if "step" in e)) == 2  # before training resumes
    assert resumed["train_losses"] == reference["train_losses"][2:]
    assert resumed["mask_hashes"] == reference["mask_hashes"]
    assert all(name in " ".join(resumed["skipped_checkpoints"])
               for name in ("checkpoint_6.mdl", "checkpoint_4.mdl"))
    for step in (4, 6):
        assert same_state(*(ckpt.load_checkpoint(ckpt.checkpoint_path(d, step))
                            for d in (resumed_dir, reference_dir)))
