"""`make gpu-check`: the training loop on a CUDA device, against this repo and torch only (no
Ray, no MLflow), in a few minutes on one GPU.

1. The GPU tests (tests/training/test_gpu.py), through pytest when it is installed.
2. Masks: a seeded RigL run on the GPU against the same run on the CPU, every mask hash (the
   initial masks must match; later ones may differ where the GPU's float rounding reorders
   near-equal scores, and the first such step is named).
3. Speed on the GPU: a masked training step (RigL 80%, no update in the timed steps, masked
   dense) against the dense step of the same model (target <= 1.05x), and tokens/s of the GPU
   against this machine's CPU on that model.

Without a CUDA device the GPU parts are skipped, with a line saying so, and the CPU side still
runs (the seeded run's masks and a short CPU timing), so the script itself is exercised:

    python bench/gpu_check.py [--quick] [--steps N] [--hidden H] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from csx_config import JobSpec  # noqa: E402  (after the repo is importable)
from record import write_json  # noqa: E402  (bench/ is on sys.path as a script)
from training.loop import train  # noqa: E402
from training.plan import plan_job  # noqa: E402

MASK_SPEC = """
train_input: {batch_size: 8, max_sequence_length: 32}
model: {preset: tiny}
optimizer: {optimizer_type: AdamW, learning_rate: 3.0e-3}
sparsity: {algorithm: rigl, sparsity: 0.8, update: {freq: 5, stop: 16}, drop_fraction: 0.3}
runconfig: {max_steps: 20, log_steps: 20, seed: 0, mlflow_experiment: "", sparse_kernel: dense}
"""
SPEED_SPEC = """
train_input: {batch_size: 16, max_sequence_length: 128}
model: {preset: tiny, hidden_size: %(hidden)d, num_hidden_layers: 4, num_heads: 8,
        filter_size: %(filter)d, max_position_embeddings: 128}
optimizer: {optimizer_type: AdamW, learning_rate: 1.0e-4}
runconfig: {max_steps: %(steps)d, log_steps: %(steps)d, seed: 0, mlflow_experiment: "",
            sparse_kernel: dense}
"""
# No mask update inside the timed steps: the ordinary masked step, as bench/masked_overhead.py.
SPARSE = "sparsity: {algorithm: rigl, sparsity: 0.8, update: {freq: 100000}}\n"


def run_gpu_tests() -> str:
    try:
        import pytest  # noqa: F401
    except ImportError:
        return "skipped: pytest is not installed"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(REPO / "tests" / "training" / "test_gpu.py")],
                            cwd=REPO, capture_output=True, text=True)
    print(result.stdout[-3000:], result.stderr[-2000:], sep="")
    return "passed" if result.returncode == 0 else f"FAILED (pytest exit {result.returncode})"


def seeded_masks(device: str, folder: Path) -> list[list[Any]]:
    summary = train(plan_job(JobSpec.from_yaml(MASK_SPEC)), model_dir=str(folder / device), device=device)
    return summary["mask_hashes"]


def compare_masks(cpu: list[list[Any]], gpu: list[list[Any]]) -> str:
    if cpu == gpu:
        return f"equal at every update ({len(cpu)} hashes)"
    if cpu[0] != gpu[0]:
        return "INITIAL MASKS DIFFER"
    step = next(c[0] for c, g in zip(cpu, gpu) if c != g)
    return f"initial masks equal; first differing update at step {step}"


def tokens_per_s(device: str, *, sparse: bool, hidden: int, steps: int, folder: Path) -> float:
    text = SPEED_SPEC % {"hidden": hidden, "filter": 4 * hidden, "steps": steps}
    text += SPARSE if sparse else ""
    name = f"{device}-{'sparse' if sparse else 'dense'}-{time.monotonic_ns()}"
    summary = train(plan_job(JobSpec.from_yaml(text)), model_dir=str(folder / name), device=device)
    return float(summary["tokens_per_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per GPU run")
    parser.add_argument("--cpu-steps", type=int, default=3, help="timed steps of the CPU run")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "gpu_check.json",
                        help="where the results go")
    parser.add_argument("--quick", action="store_true", help="10 timed GPU steps (make bench)")
    args = parser.parse_args(argv)
    load_at_start = os.getloadavg()
    if args.quick:
        args.steps = 10
    results: dict[str, Any] = {"torch": torch.__version__, "cpu_threads": torch.get_num_threads()}
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        folder = Path(tmp)
        cpu_masks = seeded_masks("cpu", folder)
        print(f"seeded RigL run on CPU: {len(cpu_masks)} mask hashes, initial "
              f"{cpu_masks[0][1][:12]}")
        if not cuda:
            # Still time the CPU side on a small model, so the benchmark code runs here too.
            cpu_tps = tokens_per_s("cpu", sparse=True, hidden=64, steps=args.cpu_steps,
                                   folder=folder)
            print(f"CPU masked step, hidden 64: {cpu_tps:,.0f} tokens/s")
            print("no CUDA device: skipped the GPU tests, the GPU-vs-CPU mask comparison and the "
                  "GPU benchmarks (run `make gpu-check` on a machine with one)")
            results.update({"cuda": False, "cpu_tokens_per_s_hidden64": cpu_tps})
        else:
            results["device"] = torch.cuda.get_device_name()
            print(f"device: {results['device']}")
            results["gpu_tests"] = run_gpu_tests()
            print(f"GPU tests: {results['gpu_tests']}")
            results["masks"] = compare_masks(cpu_masks, seeded_masks("cuda", folder))
            print(f"masks GPU vs CPU: {results['masks']}")
            tokens_per_s("cuda", sparse=False, hidden=args.hidden, steps=3, folder=folder)  # warm-up
            dense = tokens_per_s("cuda", sparse=False, hidden=args.hidden, steps=args.steps,
                                 folder=folder)
            masked = tokens_per_s("cuda", sparse=True, hidden=args.hidden, steps=args.steps,
                                  folder=folder)
            cpu = tokens_per_s("cpu", sparse=True, hidden=args.hidden, steps=args.cpu_steps,
                               folder=folder)
            results.update({"cuda": True, "hidden": args.hidden, "gpu_dense_tokens_per_s": dense,
                            "gpu_masked_tokens_per_s": masked, "cpu_masked_tokens_per_s": cpu,
                            "masked_vs_dense_step": dense / masked, "gpu_vs_cpu": masked / cpu})
            print(f"hidden {args.hidden}: GPU dense {dense:,.0f} tokens/s, masked {masked:,.0f} "
                  f"-> masked step {dense / masked:.3f}x the dense step (target <= 1.05)")
            print(f"GPU vs CPU ({torch.get_num_threads()} threads), masked: {masked:,.0f} vs "
                  f"{cpu:,.0f} tokens/s = {masked / cpu:.1f}x")
    write_json(args.json, results, load_at_start=load_at_start)
    failed = cuda and (results["gpu_tests"].startswith("FAILED")
                       or results["masks"] == "INITIAL MASKS DIFFER")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
