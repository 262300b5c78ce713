"""Checkpoints as plain dicts, written atomically, named ``checkpoint_<step>.mdl`` (ModelZoo).

A training checkpoint holds ``model`` (state_dict with the ``*_mask`` buffers), ``optimizer``,
``sparsity`` (the algorithm's state_dict), ``lr_scheduler``, ``rng``, ``data_position``,
``step``, ``phase_start`` (the step its training phase began, see training/loop.py), ``spec``
(the params as a dict), ``model_config``, ``tokenizer`` and ``mask_hashes``. Everything is
tensors and plain Python data, so ``torch.load`` runs with ``weights_only=True``.

Other checkpoints load too, for their weights: a finalized one (``model`` only), cstorch's
NaN-sentinel form (NaN at pruned positions, no masks; see ``sparsity.checkpoint``), a dense one
into a sparse run (masks from the weights' magnitudes). :func:`load_model_state` says what to do
when weights and params cannot go together.

Each checkpoint is written to a temporary file, synced, and renamed into place, with its
sha256 beside it in ``checkpoint_<step>.mdl.sha256`` (``sha256sum -c`` reads it). Loading
checks the file against it, so a truncated or altered checkpoint is refused with a reason
naming it, and a resume falls back to the newest one that loads (:func:`newest_valid_checkpoint`).
A checkpoint without that file (written before it existed, or copied alone) loads unchecked.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from models.config import ModelConfig
from training.safe_files import open_regular, os_error

log = logging.getLogger("csx")
_NAME = re.compile(r"^checkpoint_(\d+)\.mdl$")
DIGEST_SUFFIX = ".sha256"


class CorruptCheckpoint(ValueError):
    """A checkpoint file that cannot be loaded: empty, truncated, altered or not a checkpoint."""


def checkpoint_path(model_dir: str | Path, step: int) -> Path:
    return Path(model_dir) / f"checkpoint_{step}.mdl"


def digest_path(path: str | Path) -> Path:
    """Where the sha256 of checkpoint `path` is recorded."""
    path = Path(path)
    return path.with_name(path.name + DIGEST_SUFFIX)


class _HashingWriter:
    """What torch.save writes through: the file, hashed on the way. It keeps the first OSError
    a write raised, because torch reports a failed write as its own RuntimeError ("unexpected
    pos") without the cause."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file, self.sha256, self.error = file, hashlib.sha256(), None

    def write(self, data: bytes) -> int:
        try:
            written = self.file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise
        self.sha256.update(data)
        return written

    def flush(self) -> None:
        self.file.flush()


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Write to a temporary file in the same folder, sync it, record its sha256, then
    ``os.replace``: a reader (or a crash) never sees a half-written checkpoint, and a damaged
    one is found on load. An OS error (a full disk) comes out as an OSError naming the error
    and the checkpoint."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(handle, "wb") as file:
            writer = _HashingWriter(file)
            try:
                torch.save(state, writer)
            except RuntimeError as err:
                if writer.error is None:
                    raise
                raise writer.error from err
            file.flush()
            os.fsync(file.fileno())
        # The digest first: a crash between the renames leaves a checkpoint that fails its
        # check (a resume takes the one before), never one that passes unchecked.
        _write_synced(digest_path(path), f"{writer.sha256.hexdigest()}  {path.name}\n".encode())
        os.replace(tmp, path)
        tmp = None
        _sync_folder(path.parent)
    except OSError as err:
        raise os_error(err, f"writing checkpoint {path}") from err
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return path


def _write_synced(path: Path, data: bytes) -> None:
    """`data` into `path` by a synced temporary file and a rename."""
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sync_folder(folder: Path) -> None:
    """Make the renames into `folder` survive a power cut."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: str | Path, *, inside: str | Path | None = None) -> dict[str, Any]:
    """The checkpoint at `path`, checked against its recorded sha256 when there is one. With
    `inside`, a path that links out of that folder is refused (a model_dir's checkpoints); in
    every case only a regular file is read. Raises ValueError (CorruptCheckpoint for a damaged
    file, training.safe_files.RefusedFile for a link or special file) naming the file."""
    path = Path(path)
    try:
        file = open_regular(path, inside=inside)
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(f"checkpoint {str(path)!r} does not exist") from None
    with file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            raise CorruptCheckpoint(f"checkpoint {str(path)!r} is empty (0 bytes): it never "
                                    "reached the disk, or was truncated since")
        expected = _recorded_digest(path, inside)
        if expected is not None and _sha256(file) != expected:
            raise CorruptCheckpoint(
                f"checkpoint {str(path)!r} ({size} bytes) does not match the sha256 recorded in "
                f"{digest_path(path).name} when it was written: truncated or altered since")
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as err:  # torch.load's error for damaged bytes depends on where they are
            first_line = (str(err).strip().splitlines() or [""])[0][:120]
            raise CorruptCheckpoint(
                f"checkpoint {str(path)!r} ({size} bytes) cannot be read, it is truncated or "
                f"corrupt ({type(err).__name__}: {first_line})") from err
    if not isinstance(state, dict) or "model" not in state:
        raise CorruptCheckpoint(f"{str(path)!r} is not a csx checkpoint (no 'model' entry)")
    return state


def _recorded_digest(path: Path, inside: str | Path | None) -> str | None:
    """The sha256 recorded beside checkpoint `path`, or None when none was."""
    try:
        with open_regular(digest_path(path), inside=inside, text=True, encoding="ascii",
                          errors="replace") as file:
            recorded = file.read(200).split()
    except FileNotFoundError:
        return None
    if not recorded or not re.fullmatch(r"[0-9a-f]{64}", recorded[0]):
        raise CorruptCheckpoint(f"{digest_path(path).name}, the sha256 of checkpoint "
                                f"{str(path)!r}, is damaged")
    return recorded[0]


def _sha256(file: IO[bytes]) -> str:
    """The file's sha256, read from the start; leaves it at the start again."""
    digest = hashlib.sha256()
    file.seek(0)
    while chunk := file.read(1 << 20):
        digest.update(chunk)
    file.seek(0)
    return digest.hexdigest()


def list_checkpoints(model_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint in model_dir, oldest first."""
    folder = Path(model_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def latest_checkpoint(model_dir: str | Path) -> Path | None:
    found = list_checkpoints(model_dir)
    return found[-1][1] if found else None


def newest_valid_checkpoint(model_dir: str | Path) -> tuple[Path, dict[str, Any], list[str]] | None:
    """The newest checkpoint in `model_dir` that loads (see load_checkpoint), its state, and
    why each newer one was skipped (each also logged as a warning). None when model_dir holds
    no checkpoint; CorruptCheckpoint naming every file when none loads: a resume must not
    quietly start over from step 0."""
    skipped = []
    for _, path in reversed(list_checkpoints(model_dir)):
        try:
            return path, load_checkpoint(path, inside=model_dir), skipped
        except ValueError as err:  # CorruptCheckpoint, RefusedFile, or gone since listed
            log.warning("%s; trying the checkpoint before it", err)
            skipped.append(str(err))
    if skipped:
        raise CorruptCheckpoint(f"no checkpoint in {str(model_dir)!r} can be loaded, "
                                f"{len(skipped)} tried: " + "; ".join(skipped))
    return None


def finalize_checkpoint(input_path: str | Path, output_path: str | Path, *, mode: str = "zeros",
                        csr_path: str | Path | None = None) -> dict[str, Any]:
    """Fold the masks into the weights (``sparsity.checkpoint.finalize``) and write a checkpoint
    holding only the model, its config, tokenizer, step and spec; optionally also export the
    sparse weights as CSR arrays to an ``.npz`` (keys ``<param>/indptr|indices|values|shape``).
    Returns a short summary."""
    from sparsity.checkpoint import export_csr, finalize

    state = load_checkpoint(input_path)
    finalized = finalize(state["model"], mode=mode)
    kept = {k: state[k] for k in ("model_config", "tokenizer", "step", "spec") if k in state}
    save_checkpoint({**kept, "model": finalized}, output_path)
    summary: dict[str, Any] = {"output": str(output_path), "tensors": len(finalized)}
    if csr_path is not None:
        csr = export_csr(state["model"])
        arrays = {f"{name}/{field}": np.asarray(value.numpy() if torch.is_tensor(value) else value)
                  for name, parts in csr.items() for field, value in parts.items()}
        Path(csr_path).parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(csr_path, **arrays)
        summary["csr"] = str(csr_path)
        summary["csr_params"] = len(csr)
    return summary


# What an exact resume needs besides the weights; a checkpoint lacking any starts a new phase.
TRAINING_KEYS = ("optimizer", "lr_scheduler", "rng", "data_position", "step")
# A checkpoint's states by ModelZoo's names (runconfig.load_checkpoint_states) -> its entries.
STATE_ENTRIES: dict[str, tuple[str, ...]] = {
    "model": ("model",), "optimizer": ("optimizer",), "lr_scheduler": ("lr_scheduler",),
    "schedulers": ("lr_scheduler",), "sparsity": ("sparsity",), "dataloader": ("data_position",),
    "global_step": ("step", "phase_start", "best_eval_loss", "mask_hashes"),
    "grad_scaler": ("grad_scaler",), "rng": ("rng",)}
# What describes a checkpoint rather than a state of training: kept whatever is selected.
DESCRIPTION = ("spec", "model_config", "tokenizer")


def select_states(state: dict[str, Any], names: frozenset[str] | None, source: str | Path) -> dict[str, Any]:
    """The states of a checkpoint that ``load_checkpoint_states`` names (None: all), as
    ModelZoo's LoadCheckpointStates selects them: a named state the checkpoint does not hold is
    an error listing those it holds; the others are left out (logged)."""
    if names is None:
        return state
    held = sorted(name for name, entries in STATE_ENTRIES.items() if entries[0] in state)
    missing = sorted(names - set(held))
    if missing:
        raise ValueError(f"runconfig.load_checkpoint_states names {missing}, which checkpoint "
                         f"{str(source)!r} does not hold; it holds {held}")
    wanted = {entry for name in names for entry in STATE_ENTRIES[name]}
    left_out = sorted(name for name in held if name not in names)
    if left_out:
        log.info("not loading %s of %s (runconfig.load_checkpoint_states: %s)", left_out, source, sorted(names))
    return {key: value for key, value in state.items() if key in wanted or key in DESCRIPTION}


def _fitted(model: torch.nn.Module, weights: dict[str, Any], source: str | Path) -> dict[str, Any]:
    """``weights`` with the model's tensors only, the missing ones from the model as it is (a
    missing mask stays missing where its weight is given: masks then come from the weights)."""
    from sparsity.checkpoint import MASK_SUFFIX

    own = model.state_dict()
    extra = sorted(set(weights) - set(own))
    missing = sorted(key for key in set(own) - set(weights)
                     if not (key.endswith(MASK_SUFFIX) and key[: -len(MASK_SUFFIX)] in weights))
    if extra or missing:
        log.warning("checkpoint %s loaded non-strictly: %d tensors the model lacks left out %s, %d the "
                    "checkpoint lacks keep their initial values %s", source, len(extra), extra[:5],
                    len(missing), missing[:5])
    return {**{key: own[key] for key in missing}, **{k: v for k, v in weights.items() if k in own}}


def sparsity_of(state: dict[str, Any]) -> Any:
    """The ``sparsity`` section of the params a checkpoint was trained with (None: dense, or
    not recorded)."""
    spec = state.get("spec")
    return spec.get("sparsity") if isinstance(spec, dict) else None


def load_model_state(model: torch.nn.Module, algorithm: Any, state: dict[str, Any], source: str | Path,
                     model_config: dict[str, Any], *, strict: bool = True) -> dict[str, Any]:
    """Loads a checkpoint's weights into ``model`` (sparsified by ``algorithm``, or dense when
    it is None) and returns what was done, per sparse parameter ``{"saved": kept count or None
    (no mask saved), "loaded": kept count}``. The sparse path moves masks to the algorithm's
    current targets (``sparsity.checkpoint.load_into_sparse``); a mask-free checkpoint gets masks
    from its weights' magnitudes, as a sparse run started from a dense model needs.

    ``strict=False`` (runconfig.disable_strict_checkpoint_loading, as ModelZoo's
    ``load_state_dict(strict=False)``): a checkpoint of another model config loads what fits;
    tensors the model lacks are left out and tensors the checkpoint lacks keep their initial
    values (both logged); a tensor of another shape is still an error."""
    from sparsity.checkpoint import MASK_SUFFIX, load_into_sparse, recover_masks

    saved_config = state.get("model_config")
    if saved_config is not None:
        # Model keys added after the checkpoint was written take their defaults, which build
        # the model it was trained with.
        saved_config = {**asdict(ModelConfig()), **saved_config}
    if strict and saved_config is not None and saved_config != model_config:
        raise ValueError(f"checkpoint {str(source)!r} was trained with model {saved_config}, "
                         f"but the params build {model_config}")
    weights = state["model"] if strict else _fitted(model, state["model"], source)
    try:
        if algorithm is not None:
            return load_into_sparse(model, weights, algorithm, allow_dense=True)
        masked = sorted(k[: -len(MASK_SUFFIX)] for k in recover_masks(weights) if k.endswith(MASK_SUFFIX))
        if masked:
            raise ValueError(
                f"checkpoint {str(source)!r} is sparse (masks for {masked}) but the params have no "
                "sparsity section. To continue it sparse, add the sparsity section it was trained "
                f"with ({sparsity_of(state)!r} per its spec); to train or evaluate it dense, fold its "
                "masks in first: csx finalize --input CHECKPOINT --output DENSE, then "
                "runconfig.checkpoint_path: DENSE"
            )
        model.load_state_dict(weights)
        return {}
    except RuntimeError as err:  # load_state_dict's missing/unexpected keys or shapes
        raise ValueError(f"checkpoint {str(source)!r} does not fit the model the params build: {err}") from None
