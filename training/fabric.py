"""A run on the simulated fabric: its masked linears become the fabric's CSR layers, each on
the kernel the job's calibration picks (the same on every replica and every resume)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

from training.build import Run, fabric_layers
from training.safe_files import read_text

AllReduce = Callable[[list[torch.Tensor]], None]
CALIBRATION_FILE = "kernel_calibration.json"


def _job_calibration(model_dir: Path, all_reduce: AllReduce | None, write: bool) -> Any:
    """The CSR-vs-dense timing calibration, one per job: replicas and resumed runs must choose
    the same kernels (CSR and dense round differently). Each rank reads its machine's
    measurement (the same for every job there, so the same seed gives the same losses), the
    gradient all-reduce averages them so all ranks hold the same numbers, and model_dir keeps
    the result for resumes."""
    from simulator.crossover import KernelCalibration, machine_calibration

    path = model_dir / CALIBRATION_FILE
    if os.path.lexists(path):  # anything there but the job's own file is refused
        return KernelCalibration(**json.loads(read_text(path, inside=model_dir)))
    local = machine_calibration()
    values = torch.tensor(local.measurements(), dtype=torch.float64)
    if all_reduce is not None:
        all_reduce([values])
    agreed = local.with_measurements(values.tolist())
    if write:  # after the collective, so no rank can see the file half-way through the agreement
        _atomic_write_json(path, asdict(agreed))
    return agreed


def _atomic_write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload), encoding="utf-8")
    os.replace(tmp, path)


def compile_run(run: Run, world_size: int, rank: int, model_dir: Path, all_reduce: AllReduce | None) -> None:
    """Swap the masked linears (in place, same parameters, buffers and state_dict keys) for the
    simulated fabric's CSR layers where they run (training.build.fabric_layers); each picks CSR
    or dense by the simulator's rule, and the optimizer steps a CSR layer's non-zeros alone (its
    weights as values)."""
    if fabric_layers(run.alg is not None, run.settings.sparse_kernel, run.device):
        import simulator

        policy = run.settings.sparse_kernel
        # The calibration times this machine's CPU kernels: it decides for a CPU run only.
        calibrate = policy == "auto" and run.device.type == "cpu"
        calibration = _job_calibration(model_dir, all_reduce, write=rank == 0) if calibrate else None
        tokens = run.settings.global_batch_size // world_size * run.sampler.seq_len
        simulator.compile(run.model, algorithm=run.alg, tokens=tokens, kernel=policy,
                          calibration=calibration, optimizer=run.optimizer)
