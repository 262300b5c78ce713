"""Checkpoints as plain dicts, written atomically, named ``checkpoint_<step>.mdl`` (ModelZoo).

A training checkpoint holds ``model`` (state_dict with the ``*_mask`` buffers), ``optimizer``,
``sparsity`` (the algorithm's state_dict), ``lr_scheduler``, ``rng``, ``data_position``,
``step``, ``phase_start`` (the step its training phase began, see workers/train.py), ``spec``
(the params as a dict), ``model_config``, ``tokenizer`` and ``mask_hashes``. Everything is
tensors and plain Python data, so ``torch.load`` runs with ``weights_only=True``.

Other checkpoints load too, for their weights: a finalized one (``model`` only), cstorch's
NaN-sentinel form (NaN at pruned positions, no masks; see ``sparsity.checkpoint``), a dense one
into a sparse run (masks from the weights' magnitudes). :func:`load_model_state` says what to do
when weights and params cannot go together.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workers.model import ModelConfig

_NAME = re.compile(r"^checkpoint_(\d+)\.mdl$")


def checkpoint_path(model_dir: str | Path, step: int) -> Path:
    return Path(model_dir) / f"checkpoint_{step}.mdl"


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Write to a temporary file in the same folder, then ``os.replace``: a reader (or a crash)
    never sees a half-written checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint {str(path)!r} does not exist")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"{str(path)!r} is not a csx checkpoint (no 'model' entry)")
    return state


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


def sparsity_of(state: dict[str, Any]) -> Any:
    """The ``sparsity`` section of the params a checkpoint was trained with (None: dense, or
    not recorded)."""
    spec = state.get("spec")
    return spec.get("sparsity") if isinstance(spec, dict) else None


def load_model_state(model: torch.nn.Module, algorithm: Any, state: dict[str, Any], source: str | Path,
                     model_config: dict[str, Any]) -> dict[str, Any]:
    """Loads a checkpoint's weights into ``model`` (sparsified by ``algorithm``, or dense when
    it is None) and returns what was done, per sparse parameter ``{"saved": kept count or None
    (no mask saved), "loaded": kept count}``. The sparse path moves masks to the algorithm's
    current targets (``sparsity.checkpoint.load_into_sparse``); a mask-free checkpoint gets masks
    from its weights' magnitudes, as a sparse run started from a dense model needs."""
    from sparsity.checkpoint import MASK_SUFFIX, load_into_sparse, recover_masks

    saved_config = state.get("model_config")
    if saved_config is not None:
        # Model keys added after the checkpoint was written take their defaults, which build
        # the model it was trained with.
        saved_config = {**asdict(ModelConfig()), **saved_config}
    if saved_config is not None and saved_config != model_config:
        raise ValueError(f"checkpoint {str(source)!r} was trained with model {saved_config}, "
                         f"but the params build {model_config}")
    weights = state["model"]
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
