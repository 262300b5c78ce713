"""Where a run starts, and the state a checkpoint holds of it.

Resume is exact: the newest checkpoint in ``model_dir`` (else ``runconfig.checkpoint_path``)
restores weights and masks, optimizer, sparsity state, LR scheduler, RNG and data position, so
an interrupted run continues bit-identically. A run trains ``max_steps`` steps from the start of
its *phase*. A checkpoint that cannot be resumed exactly (no optimizer state: a finalized or
cstorch NaN-sentinel one) or a finished one under a changed ``sparsity`` section (iterative
pruning) starts a new phase at its step: its weights (masks moved to the new level, or made from
the weights of a dense checkpoint), data position and RNG, with a fresh optimizer, LR schedule
and sparsity algorithm, for ``max_steps`` more steps (see ``start``). Of
``runconfig.checkpoint_path`` only the states ``load_checkpoint_states`` names load
(``model``: its weights at step 0, everything else fresh; docs/modelzoo.md).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Iterator

import torch

from training import checkpoint as ckpt
from training.build import Run
from training.plan import LoopSettings


def training_state(run: Run) -> dict[str, Any]:
    """What a checkpoint holds of a run (training/checkpoint.py: plain data, resumed exactly)."""
    return {
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "sparsity": run.alg.state_dict() if run.alg is not None else None,
        "lr_scheduler": run.scheduler.state_dict(),
        "rng": _rng_state(run.device),
        "data_position": run.sampler.state_dict(),
        "step": run.step,
        "phase_start": run.phase_start,
        "spec": run.settings.spec_json,
        "model_config": run.config_dict,
        "tokenizer": run.tokenizer_json,
        "best_eval_loss": run.best_eval_loss,
        "mask_hashes": list(run.mask_hashes),
        **({"grad_scaler": run.scaler.state_dict()} if run.scaler is not None else {}),
    }


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def load_weights(run: Run, state: dict[str, Any], source: Path) -> None:
    """Weights and masks, with the sparsity state when the checkpoint was trained under the
    same sparsity section (else the algorithm only takes its step count; a changed level moves
    the masks to the new target as they load)."""
    if run.alg is not None and state.get("sparsity") is not None and ckpt.sparsity_of(state) == run.settings.sparsity_section:
        run.alg.load_state_dict(state["sparsity"])
    elif run.alg is not None:
        _set_algorithm_step(run.alg, int(state.get("step", 0)))
    if "model" in state:
        ckpt.load_model_state(run.model, run.alg, state, source, run.config_dict,
                              strict=run.settings.strict_checkpoint_loading)


def _set_algorithm_step(alg: Any, step: int) -> None:
    for member in getattr(alg, "members", [alg]):
        member.step = step


def _restore(run: Run, state: dict[str, Any], path: Path) -> None:
    """Every state the checkpoint holds (all of them for an exact resume; those
    runconfig.load_checkpoint_states selects of checkpoint_path); the others as at step 0."""
    load_weights(run, state, path)
    if "optimizer" in state:
        run.optimizer.load_state_dict(state["optimizer"])
    if "lr_scheduler" in state:
        run.scheduler.load_state_dict(state["lr_scheduler"])
    if "rng" in state:
        _set_rng_state(state["rng"], run.device)
    if "data_position" in state:
        run.sampler.load_state_dict(state["data_position"])
    run.step = int(state.get("step", 0))
    run.phase_start = int(state.get("phase_start", 0))
    run.end_step = run.phase_start + run.settings.max_steps
    run.best_eval_loss = float(state.get("best_eval_loss", math.inf))
    run.mask_hashes = list(state.get("mask_hashes", []))
    if run.scaler is not None and "grad_scaler" in state:
        run.scaler.load_state_dict(state["grad_scaler"])


def _start_phase(run: Run, state: dict[str, Any], path: Path) -> None:
    """A new phase at the checkpoint's step from its weights (and data position and RNG when
    saved); optimizer, LR schedule and sparsity algorithm start fresh, the algorithm at its
    step 0, so the sparsity section's steps count from the phase start."""
    counts = ckpt.load_model_state(run.model, run.alg, state, path, run.config_dict,
                                   strict=run.settings.strict_checkpoint_loading)
    if "data_position" in state:
        run.sampler.load_state_dict(state["data_position"])
    if "rng" in state:
        _set_rng_state(state["rng"], run.device)
    run.step = run.phase_start = int(state.get("step", 0))
    run.end_step = run.phase_start + run.settings.max_steps
    missing = [key for key in ckpt.TRAINING_KEYS if key not in state]
    made = sorted(name for name, count in counts.items() if count["saved"] is None)
    logging.getLogger("csx").info(
        "new training phase from %s at step %d (steps %d-%d)%s%s", path, run.step, run.step + 1,
        run.end_step, f"; not in the checkpoint: {missing}" if missing else "",
        f"; masks made from weight magnitudes: {made}" if made else "")


def start(run: Run, folder: Path) -> None:
    """What decides to resume. The newest checkpoint in model_dir that loads (a damaged newer
    one is skipped with a warning), else checkpoint_path:
    resumed exactly if it holds the full training state and its phase is not finished or the
    sparsity section is unchanged; otherwise a new phase starts from its weights (a finalized
    or cstorch checkpoint, a dense run's checkpoint under a sparse section, a finished run
    re-run with another sparsity: iterative pruning)."""
    newest = ckpt.newest_valid_checkpoint(folder)
    if newest is not None:
        path, state, skipped = newest
        run.skipped_checkpoints = skipped
    elif run.settings.checkpoint_path:
        path = Path(run.settings.checkpoint_path)
        state = ckpt.load_checkpoint(path)
        if run.settings.load_checkpoint_states is not None:  # ModelZoo: the run's own checkpoints load all
            _restore(run, ckpt.select_states(state, run.settings.load_checkpoint_states, path), path)
            return
    else:
        return
    step = int(state.get("step", 0))
    finished = step >= int(state.get("phase_start", 0)) + run.settings.max_steps
    changed = ckpt.sparsity_of(state) != run.settings.sparsity_section
    if any(key not in state for key in ckpt.TRAINING_KEYS) or (finished and changed):
        _start_phase(run, state, path)
        return
    _restore(run, state, path)
    if finished:
        warn(run, f"{path} is already trained to step {step} (runconfig.max_steps "
                   f"{run.settings.max_steps} from step {run.phase_start}): nothing to "
                   "train. Raise max_steps to train further, or change the sparsity section to "
                   "start a new pruning phase.")


def warn(run: Run, message: str) -> None:
    """Log a warning and keep it for the summary's `warnings`: the loop runs in a Ray worker,
    whose log the user of `csx run` or the service does not see."""
    logging.getLogger("csx").warning("%s", message)
    run.warnings.append(message)


def checkpoints_to_evaluate(settings: LoopSettings, model_dir: Path, mode: str) -> Iterator[tuple[Path, dict[str, Any]]]:
    """(path, state) of each checkpoint `mode` evaluates, loaded one at a time: every one in
    model_dir (eval_all), else runconfig.checkpoint_path, else model_dir's newest that loads."""
    if mode == "eval_all" and (found := ckpt.list_checkpoints(model_dir)):
        for _, path in found:
            yield path, ckpt.load_checkpoint(path, inside=model_dir)
    elif mode != "eval_all" and settings.checkpoint_path:
        path = Path(settings.checkpoint_path)
        yield path, ckpt.load_checkpoint(path)
    elif mode != "eval_all" and (newest := ckpt.newest_valid_checkpoint(model_dir)) is not None:
        yield newest[0], newest[1]
    else:
        raise ValueError(f"mode {mode!r} needs a checkpoint, but model_dir {str(model_dir)!r} has none "
                         "(and runconfig.checkpoint_path is not set)")
