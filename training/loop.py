"""The training loop: one explicit loop, the same on one process or on every data-parallel rank.
``train`` builds this rank's ``Run`` from the job's plan (training/plan.py, training/build.py);
the loop reads the run and the plan's ``LoopSettings``, never the spec.

Per optimizer step ``t`` (1-based), in order: LR for step t; forward/backward on this rank's
slice of global batch t (the sparsity gradient hooks mask gradients before backward returns);
``all_reduce`` of the gradients, the dense gradients captured for a mask update, and the loss
across ranks; gradient clipping; ``optimizer.step()`` (the sparsity hooks fire here
and update masks on update steps); mask hash on update steps; evaluation every
``eval_frequency``; checkpoint every ``checkpoint_steps`` (rank 0); metrics every ``log_steps``
(rank 0, through the tracker).

Where a run starts (resume, a new training phase, the checkpoints an evaluation
reads) is training/resume.py's; the fabric's CSR kernels, training/fabric.py's.

Device: the rank's ``device`` (``cpu``, or ``cuda`` where the runner granted a GPU) holds the
model, masks, optimizer state and each batch; the model is built and masked on the CPU first,
so a seeded run starts from the same weights and masks on either. On CUDA the fabric's
``sparse_kernel: auto`` runs masked dense, and the precision keys apply (training/precision.py);
the step is the host's launches there (docs/design.md §1), so the step's loss stays on the
device until the log step reads the window's losses at once, and ``runconfig.torch_compile``
compiles the model by default.
Resume on CUDA restores the CUDA generator too; it is bit-identical only where the kernels are
deterministic (cuBLAS reductions may differ between runs unless CUBLAS_WORKSPACE_CONFIG and
``torch.use_deterministic_algorithms`` are set), so the exact-resume guarantee is for CPU.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch

from models.moe import expert_parts
from training import checkpoint as ckpt
from training.build import Run, build_run
from training.fabric import AllReduce, compile_run
from training.filters import checked_groups, unmatched_patterns
from training.perf import PerfProjector
from training.plan import MODES, JobPlan
from training.resume import checkpoints_to_evaluate, load_weights, start, training_state, warn

AFTER_WARMUP = "eval/perplexity_after_warmup"
# The progress event a resume sends for each damaged checkpoint it passed over.
SKIPPED_CHECKPOINT = "checkpoint_skipped"


def mask_hash(alg: Any) -> str:
    """sha256 of all masks concatenated (algorithm order): equal on replicas iff masks agree."""
    digest = hashlib.sha256()
    for _, _, mask in alg.sparse_parameters():
        digest.update(mask.contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def evaluate(run: Run, all_reduce: AllReduce | None) -> dict[str, float]:
    """Mean cross-entropy over the fixed eval batches (averaged over ranks) and perplexity, in
    eval mode: no dropout, and an MoE's load-balancing loss left out, as nanoGPT's estimate_loss
    (in training mode it cost 0.10 of validation loss at dropout 0.2: docs/science.md)."""
    total = torch.zeros(1, dtype=torch.float64, device=run.device)
    run.model.eval()
    try:
        for inputs, targets in run.eval_data:
            with run.precision.autocast(run.device):
                _, loss = run.model(inputs.to(run.device), targets.to(run.device))
            total += loss.double()
    finally:
        run.model.train()
    total /= len(run.eval_data)
    if all_reduce is not None:
        all_reduce([total])
    loss = float(total)
    return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 700.0))}


class MaskDivergence(RuntimeError):
    """Data-parallel replicas ended a mask update with different masks."""


def _check_replicas_agree(step: int, digest: str, all_reduce: AllReduce,
                          device: torch.device = torch.device("cpu")) -> None:
    """Fail fast on the first diverging update: the mean over ranks of a 48-bit slice of the
    mask hash (exact in float64) equals this rank's value on every rank iff all ranks agree."""
    local = float(int(digest[:12], 16))
    value = torch.tensor([local], dtype=torch.float64, device=device)
    all_reduce([value])
    if value.item() != local:
        raise MaskDivergence(f"replicas hold different masks after the update at step {step}")


class _MetricLog:
    """Collects metrics per step and hands them to the tracker every log_steps (rank 0)."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.pending: dict[int, dict[str, float]] = {}

    def add(self, step: int, metrics: dict[str, float]) -> None:
        if self.tracker is not None:
            self.pending.setdefault(step, {}).update(metrics)

    def flush(self) -> None:
        for step in sorted(self.pending):
            self.tracker.log_metrics(self.pending[step], step)
        self.pending.clear()


def _to_device(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """A batch on ``device``; to a GPU from pinned memory without the host waiting for the copy
    (nanoGPT's get_batch), so the host goes on queuing the step."""
    if device.type != "cuda":
        return tuple(tensor.to(device) for tensor in batch)
    return tuple(tensor.pin_memory().to(device, non_blocking=True) for tensor in batch)


def _wait_for_device(device: torch.device) -> None:
    """Until a GPU has run what the host queued, so a step's time is its own, not the next
    timed step's or an evaluation's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _optimizer_step(run: Run, all_reduce: AllReduce | None) -> tuple[torch.Tensor, bool]:
    """One step on this rank's slice of the next global batch; returns (global loss, a
    one-element float32 tensor on the run's device, left there: reading it would make the host
    wait for the GPU at every step; whether the step produced dense gradients for a mask
    update)."""
    inputs, targets = _to_device(run.sampler.next_batch(), run.device)
    run.optimizer.zero_grad(set_to_none=True)
    with run.precision.autocast(run.device):
        _, loss = run.model(inputs, targets)
    (run.scaler.scale(loss) if run.scaler is not None else loss).backward()
    step_loss = loss.detach().float().reshape(1).clone()  # one collective with the grads
    # What the optimizer steps, read after the forward: the fabric's CSR layers put their
    # weights' values in the dense weights' place on the steps that do not update masks.
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    router_load = run.model.router_load()  # this rank's slice; the global batch's after the collective
    if all_reduce is not None:
        # Before clipping and the optimizer step. Gradients are masked already (the sparsity
        # hooks ran in backward); on an update step RigL/GraNet grow from the averaged dense
        # gradient the hooks captured, so it travels in the same collective.
        dense = run.alg.captured_dense_grads() if run.alg is not None else []
        all_reduce([p.grad for p in params if p.grad is not None] + dense + [step_loss]
                   + ([router_load] if router_load is not None else []))
    if router_load is not None:
        run.router_loads.append(router_load)
    if run.scaler is not None:
        # Every rank holds the same averaged gradients, so every rank skips the same steps
        # (and, with them, their mask updates).
        run.scaler.unscale_(run.optimizer)
    if run.settings.max_gradient_norm:
        torch.nn.utils.clip_grad_norm_(params, run.settings.max_gradient_norm)
    dense_grad = run.alg is not None and run.alg.needs_dense_grad()
    if run.scaler is not None:
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        run.optimizer.step()  # sparsity hooks: mask grads/state, re-mask weights, update masks
    run.scheduler.step()
    run.step += 1
    return step_loss, dense_grad


def _train_steps(run: Run, *, world_size: int, rank: int, model_dir: Path, evaluate_periodically: bool,
                 all_reduce: AllReduce | None, tracker: Any, progress: Callable[[dict], None] | None,
                 summary: dict[str, Any]) -> None:
    rc = run.settings
    global_tokens = run.settings.global_batch_size * run.sampler.seq_len
    projector = PerfProjector(run.model, run.alg, seq_len=run.sampler.seq_len,
                              global_tokens=global_tokens, num_csx=world_size)
    log = _MetricLog(tracker if rank == 0 else None)
    window_losses: list[torch.Tensor] = []  # on the device until the log step reads them
    train_seconds, steps_timed = 0.0, 0
    if run.alg is not None and not run.mask_hashes:
        run.mask_hashes.append([run.step, mask_hash(run.alg)])
    if run.alg is not None and run.step == 0 and tracker is not None and rank == 0:
        # The initial mask: Static's only one, and where every dynamic run starts from.
        log.add(0, _sparsity_metrics(run, 0))
        tracker.log_mask_update(0, {n: m.clone() for n, _, m in run.alg.sparse_parameters()})
    while run.step < run.end_step:
        lr = run.optimizer.param_groups[0]["lr"]
        started = time.perf_counter()
        step_loss, dense_grad = _optimizer_step(run, all_reduce)
        window_losses.append(step_loss)
        is_last = run.step == run.end_step
        log_step = is_last or run.step % rc.log_steps == 0
        evaluates = evaluate_periodically and rc.eval_frequency and run.step % rc.eval_frequency == 0
        checkpoints = rank == 0 and (is_last or (rc.checkpoint_steps and run.step % rc.checkpoint_steps == 0))
        updated = run.alg is not None and run.alg.is_update_step(run.alg.step)
        if log_step:  # the window's losses in one read: the host's one wait for the GPU
            losses = torch.cat(window_losses).tolist()
            summary["train_losses"] += [[run.step - len(losses) + 1 + index, loss]
                                        for index, loss in enumerate(losses)]
        elif evaluates or checkpoints or updated:
            _wait_for_device(run.device)
        train_seconds += time.perf_counter() - started
        steps_timed += 1

        if updated:
            run.mask_hashes.append([run.step, mask_hash(run.alg)])
            if all_reduce is not None:
                _check_replicas_agree(run.step, run.mask_hashes[-1][1], all_reduce, run.device)
            log.add(run.step, _sparsity_metrics(run, run.step))
            if tracker is not None and rank == 0:
                tracker.log_mask_update(run.step, {n: m.clone() for n, _, m in run.alg.sparse_parameters()})
        if evaluates:
            _record_eval(run, evaluate(run, all_reduce), summary, log)
        if log_step:
            tokens_per_s = global_tokens * steps_timed / train_seconds
            # host/: what this machine measured; perf/: the simulated CS-2's projection.
            metrics = {"train/loss": sum(losses) / len(losses), "lr": lr,
                       "host/tokens_per_s": tokens_per_s, **projector.metrics(dense_grad)}
            if run.router_loads:
                metrics.update(router_load_metrics(run.router_loads))
                run.router_loads.clear()
            if run.alg is None:
                metrics["sparsity/global"] = 0.0  # so dense shows in the sparsity chart too
            else:  # mask/* belong to update steps, logged there
                metrics.update({k: v for k, v in _sparsity_metrics(run, run.step).items()
                                if not k.startswith("mask/")})
            log.add(run.step, metrics)
            log.flush()
            window_losses.clear()
            summary["train_loss"] = metrics["train/loss"]
            summary["tokens_per_s"] = tokens_per_s
            summary.update({k.removeprefix("perf/"): v for k, v in metrics.items()
                            if k.startswith("perf/")})
        if checkpoints:
            summary["checkpoint"] = str(ckpt.save_checkpoint(training_state(run), ckpt.checkpoint_path(model_dir, run.step)))
            if tracker is not None:  # a resume starts after this step: its metrics must reach MLflow now
                log.flush()
                tracker.flush()
        if log_step and progress is not None:  # per log step: for the Ray runner a round trip
            progress({"step": run.step, "max_steps": run.end_step, "loss": metrics["train/loss"],
                      "lr": lr, "tokens_per_s": tokens_per_s,
                      "eta_s": (run.end_step - run.step) * train_seconds / steps_timed})
    log.flush()


def _sparsity_metrics(run: Run, step: int) -> dict[str, float]:
    """`alg.metrics()` with each layer's scheduled target at `step` (GraNet's update records
    the levels its global pruning reached, which equal the actual ones), and each expert's."""
    metrics = run.alg.metrics()
    for name, level in run.alg.layer_targets(step).items():
        metrics[f"sparsity/{name}/target"] = float(level)
    metrics.update(expert_sparsity_metrics(run.alg, run.model))
    return metrics


def expert_sparsity_metrics(alg: Any, model: torch.nn.Module) -> dict[str, float]:
    """`experts/sparsity/L<layer>.expert<e>` (`.shared<s>`): the sparsity of all of an expert's
    sparse matrices together, its slice of a fused one included (the per-matrix levels are
    `sparsity/<param>/actual`); {} without experts."""
    live: dict[str, list[int]] = {}
    for name, _, mask in alg.sparse_parameters():
        for layer, label, part in expert_parts(model, name):
            kept = mask if part is None else mask[part]
            counts = live.setdefault(f"experts/sparsity/L{layer:02d}.{label}", [0, 0])
            counts[0] += int(kept.sum())
            counts[1] += kept.numel()
    return {key: 1.0 - nonzero / total for key, (nonzero, total) in live.items()}


def router_load_metrics(loads: list[torch.Tensor]) -> dict[str, float]:
    """`router/load/L<layer>.expert<e>`: the share of a MoE layer's token-to-expert assignments
    each routed expert received (Transformer.router_load), averaged over `loads`, the steps
    since the last log. Every decoder layer of a MoE model is a MoE layer, so row i is layer i."""
    window = torch.stack(loads).mean(0).tolist()
    return {f"router/load/L{layer:02d}.expert{expert}": share
            for layer, row in enumerate(window) for expert, share in enumerate(row)}


def _record_eval(run: Run, metrics: dict[str, float], summary: dict[str, Any], log: _MetricLog) -> None:
    """Log an evaluation; past a warm-up also as `AFTER_WARMUP`, a chart whose axis spans the
    perplexities that tell variants apart, not the hundreds of the first steps."""
    warmup = run.settings.warmup_steps
    if warmup and run.step - run.phase_start > warmup:
        metrics = {**metrics, AFTER_WARMUP: metrics["eval/perplexity"]}
    run.best_eval_loss = min(run.best_eval_loss, metrics["eval/loss"])
    summary["eval_history"].append({"step": run.step, "loss": metrics["eval/loss"],
                                    "perplexity": metrics["eval/perplexity"]})
    log.add(run.step, metrics)
    log.flush()


def train(plan: JobPlan, *, model_dir: str, mode: str = "train", rank: int = 0,
          all_reduce: AllReduce | None = None, tracker: Any = None,
          progress: Callable[[dict], None] | None = None, device: str = "cpu") -> dict:
    """Run ``mode`` (train | eval | train_and_eval | eval_all) as rank ``rank`` of the plan's
    ``num_csx``.

    Returns a summary: steps, train_loss, final/best eval loss and perplexity, eval_history,
    train_losses ([step, loss] of the steps run here), tokens_per_s, the perf projection
    (sim_step_ms, speedup_vs_dense, scaling_efficiency), mask_hashes ([step, sha256] pairs: initial
    masks and every update step), kernels (the fabric's CSR/dense choice per sparse layer),
    the last checkpoint written, the device, the precision applied, torch_compile (whether
    torch.compile ran the model), and
    skipped_checkpoints (why each damaged checkpoint newer than the one resumed from was passed
    over; only when there were any).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    world_size = plan.num_csx
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, num_csx={world_size}), got {rank}")
    where = torch.device(device)
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA device here")
    folder = Path(model_dir)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    run = build_run(plan, folder, rank, where)
    if run.alg is not None:
        checked_groups(run.alg)
    for warning in unmatched_patterns(plan.sparsity, [name for name, _ in run.model.named_parameters()]):
        warn(run, warning)
    if rank == 0:
        (folder / "params.yaml").write_text(run.settings.params_yaml, encoding="utf-8")
    summary: dict[str, Any] = {"mode": mode, "eval_history": [], "train_losses": [],
                               "device": str(where), "precision": run.precision.applied,
                               "torch_compile": False}
    if rank == 0:
        logging.getLogger("csx").info("training on %s, %d torch threads, precision: %s", where,
                                      torch.get_num_threads(), run.precision.applied)
    log = _MetricLog(tracker if rank == 0 else None)

    if mode in ("eval", "eval_all"):
        compile_run(run, world_size, rank, folder, all_reduce)  # loading a checkpoint later updates the CSR layers' tensors in place
        for path, state in checkpoints_to_evaluate(run.settings, folder, mode):
            load_weights(run, state, path)
            run.step = int(state.get("step", 0))
            _record_eval(run, evaluate(run, all_reduce), summary, log)
    else:
        start(run, folder)
        if progress is not None:  # into the job's log too, not only this worker's stderr
            for reason in run.skipped_checkpoints:
                progress({"event": SKIPPED_CHECKPOINT, "reason": reason})
        compile_run(run, world_size, rank, folder, all_reduce)
        initial = ckpt.checkpoint_path(folder, run.step)
        if rank == 0 and run.settings.save_initial_checkpoint and not initial.exists():
            summary["initial_checkpoint"] = str(ckpt.save_checkpoint(training_state(run), initial))
        if run.torch_compile:  # in place: the same module, parameters and state_dict keys
            run.model.compile()
            summary["torch_compile"] = True
        _train_steps(run, world_size=world_size, rank=rank, model_dir=folder,
                     evaluate_periodically=mode == "train_and_eval", all_reduce=all_reduce,
                     tracker=tracker, progress=progress, summary=summary)
        evaluated_last = summary["eval_history"] and summary["eval_history"][-1]["step"] == run.step
        if mode == "train_and_eval" and not evaluated_last:
            _record_eval(run, evaluate(run, all_reduce), summary, log)
    return _finish(run, summary)


def _finish(run: Run, summary: dict[str, Any]) -> dict[str, Any]:
    summary.update({"steps": run.step, "mask_hashes": list(run.mask_hashes),
                    "warnings": list(run.warnings)})
    if run.skipped_checkpoints:
        summary["skipped_checkpoints"] = list(run.skipped_checkpoints)
    if run.alg is not None:
        import simulator

        # without the fabric's layers (CUDA), every masked linear runs masked dense
        summary["kernels"] = {d.name: d.kernel for d in simulator.decisions(run.model)} or {
            name: "dense" for name, module in run.model.named_modules()
            if isinstance(module, torch.nn.Linear) and "weight_mask" in module._buffers}
        # per-layer final densities: what a study projects onto the full-size model
        summary["layer_density"] = {name: float(mask.float().mean())
                                    for name, _, mask in run.alg.sparse_parameters()}
    if summary["eval_history"]:
        last = summary["eval_history"][-1]
        best = min(summary["eval_history"], key=lambda entry: entry["loss"])
        best_loss = min(run.best_eval_loss, best["loss"])
        summary.update({"final_eval_loss": last["loss"], "final_eval_perplexity": last["perplexity"],
                        "best_eval_loss": best_loss, "best_eval_perplexity": math.exp(min(best_loss, 700.0))})
    return summary
