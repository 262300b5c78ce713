"""`make gpu-check`: our training loop on a CUDA device beside nanoGPT's, at nanoGPT's GPU
configuration (examples/nanogpt_shakespeare_gpu.yaml), in about five minutes on one H100
(issue 42). Torch and this repo only: no Ray, no MLflow.

On a GPU, in this order:
1. Speed, each run alone on the GPU: nanoGPT's train.py compiled (its default, which is also
   its loss run) and eager (``--compile=False``), when a nanoGPT checkout is given
   (``--nanogpt`` or ``NANOGPT``: its code is not ours to ship); ours dense with
   runconfig.torch_compile's default (compiled on CUDA; also our dense loss run) and eager,
   and RigL at 80% (its mask updates every 100 steps included) compiled and eager. Tokens/s
   from the wall clock between log steps (where both read the loss, so the GPU has caught up)
   after the first 50 steps and outside evaluations; MFU by nanoGPT's own estimate for both
   (6N + 12·L·H·Q·T FLOPs a token against an A100's 312 bf16 TFLOP/s).
2. Sharing the GPU: the five algorithms at 80% (Static, GMP, SET, RigL, GraNet) for the loss
   runs' steps, with the GPU tests (tests/training/test_gpu.py, through pytest) and the masks:
   seeded SET, RigL and GraNet runs on the GPU against the same runs on the CPU, hash by hash
   (the initial masks and the first update must be equal).
3. Ours vs nanoGPT (validation loss, tokens/s, MFU), into the JSON (default
   bench/results/gpu_check.json): device, cuda, gpu_tests, masks, masked_vs_dense_step,
   dense_vs_nanogpt_eager, dense_vs_nanogpt_compiled, dense_best_val_loss,
   nanogpt_best_val_loss, and the figures behind them.

Both train on the same text: our corpus (builtin:shakespeare, a byte a token) written as
nanoGPT's train.bin / val.bin. The loss runs take the first ``--loss-steps`` (default 1500;
nanoGPT's best validation loss comes near step 1750) of the 5,000-step schedule.

Without a CUDA device it says so and exercises its CPU side in seconds (default JSON
bench/results/gpu_check_cpu.json, so a GPU run's file is not overwritten): the five sparsity
sections configure, ours dense and RigL run a few steps of a tiny model through the same child
processes, and nanoGPT's train.py a few CPU iterations when a checkout is given.

    python bench/gpu_check.py [--nanogpt DIR] [--loss-steps N] [--speed-steps N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, not installed

from csx_config import JobSpec  # noqa: E402  (after the repo is importable)
from bench.record import write_json  # noqa: E402  (imported as bench.gpu_check too)
from training.plan import plan_job  # noqa: E402

LOAD_AT_START = os.getloadavg()

CONFIG = REPO / "examples" / "nanogpt_shakespeare_gpu.yaml"
RESULTS = REPO / "bench" / "results"
WARMUP_STEPS = 50  # compilation and the first launches: not timed
EVAL_EVERY = 250
A100_BF16_FLOPS = 312e12  # nanoGPT's estimate_mfu
UPDATE = "{freq: 100, stop: 3750}"  # the RigL paper's ΔT, until 75% of the 5,000 steps
DROP = "{type: cosine, init: 0.3, half_period: 3750}"
VARIANTS = {
    "static": "{algorithm: static, sparsity: 0.8}",
    "gmp": "{algorithm: gmp, sparsity: {type: cubic, init_sparsity: 0.0, end_sparsity: 0.8, "
           "sparsity_start_step: 0, sparsity_end_step: 3500, prune_every_k_steps: 100}, "
           "update: {freq: 100, stop: 3600}}",
    "set": "{algorithm: set, sparsity: 0.8, update: " + UPDATE + ", drop_fraction: " + DROP + "}",
    "rigl": "{algorithm: rigl, sparsity: 0.8, update: " + UPDATE + ", drop_fraction: " + DROP + "}",
    "granet": "{algorithm: granet, init_sparsity: 0.5, sparsity: 0.8, update: " + UPDATE
              + ", drop_fraction: " + DROP + ", pruning: global}",
}
QUIET = ["runconfig.mlflow_experiment=", "runconfig.checkpoint_steps=0"]
# The masks check: a tiny seeded run, float32, the fabric's layers masked dense on both.
MASK_SPEC = """
train_input: {batch_size: 8, max_sequence_length: 32}
model: {preset: tiny}
optimizer: {optimizer_type: AdamW, learning_rate: 3.0e-3}
runconfig: {max_steps: 12, log_steps: 12, seed: 0, mlflow_experiment: "", sparse_kernel: dense,
            torch_compile: false}
"""
MASK_ALGORITHMS = {name: VARIANTS[name].replace(UPDATE, "{freq: 5, stop: 11}")
                   for name in ("set", "rigl", "granet")}
# The CPU side: a model small enough that a few steps take a second.
TINY = ["model.hidden_size=48", "model.filter_size=192", "model.num_hidden_layers=2",
        "train_input.batch_size=2", "train_input.max_sequence_length=32",
        "eval_input.batch_size=2", "eval_input.max_sequence_length=32", "runconfig.eval_steps=2"]
NANOGPT_TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=2",
                "--eval_iters=2", "--eval_interval=2", "--log_interval=1", "--dtype=float32"]


def torch_build() -> str:
    cuda = torch.version.cuda
    return f"torch {torch.__version__} ({f'a CUDA {cuda} build' if cuda else 'a CPU build'})"


# ------------------------------------------------------------------------------ our runs
def our_task(name: str, overrides: list[str], *, steps: int, mode: str) -> dict[str, Any]:
    return {"name": name, "mode": mode, "overrides": QUIET + [f"runconfig.max_steps={steps}", *overrides]}


def run_one(task_file: Path) -> int:
    """The child process of one of our runs: train, then the summary and timed log steps."""
    from training.loop import train

    task = json.loads(task_file.read_text(encoding="utf-8"))
    spec = JobSpec.from_yaml(CONFIG.read_text(encoding="utf-8"), task["overrides"])
    logs: list[list[float]] = []
    summary = train(plan_job(spec), model_dir=str(task_file.parent / "model"), mode=task["mode"],
                    device=task["device"],
                    progress=lambda event: logs.append([event["step"], time.perf_counter()])
                    if "tokens_per_s" in event else None)
    summary["log_times"] = logs
    (task_file.parent / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    return 0


def launch(task: dict[str, Any], device: str, folder: Path, threads: int | None = None) -> subprocess.Popen:
    folder.mkdir(parents=True)
    (folder / "task.json").write_text(json.dumps({**task, "device": device}), encoding="utf-8")
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    with open(folder / "log.txt", "w", encoding="utf-8") as log:  # the child keeps its own handle
        return subprocess.Popen([sys.executable, __file__, "--run-one", str(folder / "task.json")],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def collect(process: subprocess.Popen, folder: Path, timeout: float) -> dict[str, Any]:
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return {"error": f"over {timeout:.0f} s"}
    if code != 0 or not (folder / "summary.json").exists():
        tail = (folder / "log.txt").read_text(errors="replace")[-1500:]
        return {"error": f"exit code {code}: {tail}"}
    return json.loads((folder / "summary.json").read_text(encoding="utf-8"))


def tokens_per_s(log_times: list[list[float]], tokens_per_step: int, warmup: int) -> float | None:
    """Tokens/s over the windows between consecutive log steps after `warmup` steps, leaving
    out the windows an evaluation falls in and the last one (our final checkpoint and
    evaluation are in it)."""
    steps = seconds = 0.0
    for (first, start), (last, end) in zip(log_times[:-1], log_times[1:-1]):
        evaluated = int(last) // EVAL_EVERY > int(first) // EVAL_EVERY
        if first >= warmup and not evaluated:
            steps, seconds = steps + last - first, seconds + end - start
    return tokens_per_step * steps / seconds if seconds > 0 else None


def best_loss(history: list[tuple[int, float]]) -> float | None:
    return min((loss for _, loss in history), default=None)


# ------------------------------------------------------------------------------ nanoGPT
def nanogpt_checkout(given: Path | None) -> tuple[Path | None, str]:
    if given is None:
        return None, ("not run: no nanoGPT checkout (NANOGPT=dir or --nanogpt; e.g. git clone "
                      "https://github.com/karpathy/nanoGPT)")
    if not (given / "train.py").is_file() or not (given / "config" / "train_shakespeare_char.py").is_file():
        return None, f"not run: {given} is not a nanoGPT checkout (no train.py and config/)"
    return given, str(given)


def write_nanogpt_data(folder: Path, data_dir: str = "builtin:shakespeare") -> Path:
    """A text corpus of ours as nanoGPT's prepared data (its data/<dataset> folder): the train
    and validation token streams, a byte a token, as uint16, and meta.pkl with the vocabulary
    size. research/eval_mode_gap.py trains nanoGPT on it too."""
    import numpy as np

    from training.text import ByteTokenizer, encode_documents, load_splits

    splits, tokenizer = load_splits(data_dir), ByteTokenizer()
    folder.mkdir(parents=True, exist_ok=True)
    for name, documents in (("train", splits.train), ("val", splits.validation)):
        np.asarray(encode_documents(tokenizer, documents).numpy(), dtype=np.uint16).tofile(folder / f"{name}.bin")
    with open(folder / "meta.pkl", "wb") as meta:
        pickle.dump({"vocab_size": 256}, meta)
    return folder


def run_nanogpt(checkout: Path, data: Path, out: Path, *, compiled: bool, steps: int, device: str,
                extra: list[str], timeout: float) -> dict[str, Any]:
    """nanoGPT's train.py on its shakespeare_char config and our data; its log lines, each
    timed as it arrives (printed right after its loss.item(), so the GPU has caught up)."""
    command = [sys.executable, str(checkout / "train.py"), str(checkout / "config" / "train_shakespeare_char.py"),
               f"--dataset={data}", f"--out_dir={out}", f"--max_iters={steps}", "--lr_decay_iters=5000",
               f"--compile={compiled}", f"--device={device}", *extra]
    started, lines, log_times, history, mfu = time.perf_counter(), [], [], [], None
    process = subprocess.Popen(command, cwd=checkout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in process.stdout:
        lines.append(line)
        if (match := re.match(r"iter (\d+): loss [\d.]+, time [\d.]+ms, mfu (-?[\d.]+)%", line)):
            log_times.append([int(match[1]), time.perf_counter()])
            mfu = float(match[2]) / 100
        elif (match := re.match(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", line)):
            history.append((int(match[1]), float(match[2])))
        if time.perf_counter() - started > timeout:
            process.kill()
            return {"error": f"over {timeout:.0f} s", "command": command}
    if process.wait() != 0:
        return {"error": f"exit code {process.returncode}: {''.join(lines)[-1500:]}", "command": command}
    return {"log_times": log_times, "eval_history": history, "nanogpt_mfu": mfu, "command": command}


# ------------------------------------------------------------------------------ the checks
def flops_per_token(spec: JobSpec) -> float:
    """nanoGPT's estimate_mfu: 6N + 12·L·H·Q·T, N the parameters without position embeddings."""
    from models.transformer import build_model
    from training.build import model_config

    seq_len = spec.train_input.max_sequence_length
    config = model_config(spec, 256, seq_len)
    model = build_model(config, seed=0, device="meta")
    positions = getattr(model.embedding_layer, "position_embeddings", None)
    n = model.num_parameters() - (positions.weight.numel() if positions is not None else 0)
    return 6 * n + 12 * config.num_hidden_layers * config.num_heads * config.head_dim * seq_len


def run_gpu_tests() -> subprocess.Popen | str:
    try:
        import pytest  # noqa: F401
    except ImportError:
        return "skipped: pytest is not installed"
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/training/test_gpu.py"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def compare_masks(folder: Path, device: str = "cuda") -> dict[str, str]:
    """Each algorithm's mask hashes, GPU against CPU: the initial masks, then the first update."""
    from training.loop import train

    verdicts = {}
    for name, section in MASK_ALGORITHMS.items():
        spec = JobSpec.from_yaml(MASK_SPEC, [f"sparsity={section}"])
        cpu, gpu = (train(plan_job(spec), model_dir=str(folder / f"{name}-{where}-{index}"), device=where)["mask_hashes"]
                    for index, where in enumerate(("cpu", device)))
        if cpu[0] != gpu[0]:
            verdicts[name] = "INITIAL MASKS DIFFER"
        elif cpu[1] != gpu[1]:
            verdicts[name] = f"FIRST UPDATE DIFFERS (step {cpu[1][0]})"
        else:
            later = next((c[0] for c, g in zip(cpu[2:], gpu[2:]) if c != g), None)
            verdicts[name] = (f"equal at the first update (step {cpu[1][0]})"
                              + ("" if later is None else f"; later updates differ from step {later}"))
    return verdicts


@dataclass(frozen=True)
class Plan:
    """Where and how big the GPU check runs: on CUDA at the configuration's size, or rehearsed
    on a CPU with a tiny model (which checks this script, and measures nothing)."""

    device: str = "cuda"
    ours: tuple[str, ...] = ()  # overrides of every run of ours
    nanogpt: tuple[str, ...] = ()  # arguments of every nanoGPT run
    warmup: int = WARMUP_STEPS


REHEARSAL = Plan("cpu", (*TINY, "runconfig.log_steps=2"), (*NANOGPT_TINY, "--compile=False"), warmup=0)


def gpu_check(args: argparse.Namespace, folder: Path, results: dict[str, Any], plan: Plan,
              out: Path) -> bool:
    spec = JobSpec.from_yaml(CONFIG.read_text(encoding="utf-8"), list(plan.ours))
    tokens, flops = results["tokens"], flops_per_token(spec)
    checkout, results["nanogpt"] = nanogpt_checkout(args.nanogpt)
    speed: dict[str, float | None] = {}
    losses: dict[str, list] = {}
    errors: dict[str, str] = {}
    if checkout is not None:  # 1. nanoGPT alone: compiled (its loss run), then eager
        data = write_nanogpt_data(folder / "nanogpt-data")
        for name, compiled, steps in (("nanogpt_compiled", True, args.loss_steps),
                                      ("nanogpt_eager", False, args.speed_steps)):
            print(f"{name}: {steps} iterations", flush=True)
            run = run_nanogpt(checkout, data, folder / name, compiled=compiled, steps=steps,
                              device=plan.device, extra=list(plan.nanogpt), timeout=args.timeout)
            if "error" in run:
                errors[name] = run["error"]
                continue
            speed[name] = tokens_per_s(run["log_times"], tokens, plan.warmup)
            losses[name] = run["eval_history"]
            results.setdefault("nanogpt_own_mfu", {})[name] = run["nanogpt_mfu"]
    ours = {  # 1. ours alone: dense compiled (our loss run), dense eager, RigL compiled and eager
        "dense_compiled": our_task("dense_compiled", [], steps=args.loss_steps, mode="train_and_eval"),
        "dense_eager": our_task("dense_eager", ["runconfig.torch_compile=false"], steps=args.speed_steps, mode="train"),
        "rigl_compiled": our_task("rigl_compiled", [f"sparsity={VARIANTS['rigl']}"], steps=args.speed_steps, mode="train"),
        "rigl_eager": our_task("rigl_eager", [f"sparsity={VARIANTS['rigl']}", "runconfig.torch_compile=false"],
                               steps=args.speed_steps, mode="train")}
    for name, task in ours.items():
        print(f"ours {name}: {task['overrides'][len(QUIET)].split('=')[1]} steps", flush=True)
        task["overrides"] += plan.ours
        summary = collect(launch(task, plan.device, folder / name), folder / name, args.timeout)
        if "error" in summary:
            errors[name] = summary["error"]
            continue
        speed[name] = tokens_per_s(summary["log_times"], tokens, plan.warmup)
        losses[name] = [(e["step"], e["loss"]) for e in summary["eval_history"]]
    results.update(tokens_per_s=speed, errors=errors)
    write(out, results)  # what the speed runs gave, should the rest run out of time
    # 2. sharing the GPU: the five algorithms' loss runs, the GPU tests, the masks
    print(f"sharing the GPU: {', '.join(VARIANTS)} at 80% ({args.loss_steps} steps), the GPU "
          "tests, the masks", flush=True)
    variants = {name: launch(our_task(name, [f"sparsity={section}", *plan.ours], steps=args.loss_steps,
                                      mode="train_and_eval"), plan.device, folder / f"variant-{name}", threads=2)
                for name, section in VARIANTS.items()}
    tests = run_gpu_tests()
    results["masks"] = compare_masks(folder / "masks", plan.device)
    if isinstance(tests, str):
        results["gpu_tests"] = tests
    else:
        output = tests.communicate()[0]
        print(output[-3000:])
        results["gpu_tests"] = "passed" if tests.returncode == 0 else f"FAILED (pytest exit {tests.returncode})"
    for name, process in variants.items():
        summary = collect(process, folder / f"variant-{name}", args.timeout)
        if "error" in summary:
            errors[f"variant {name}"] = summary["error"]
        else:
            losses[f"variant_{name}"] = [(e["step"], e["loss"]) for e in summary["eval_history"]]

    def ratio(a: str, b: str) -> float | None:
        return speed[a] / speed[b] if speed.get(a) and speed.get(b) else None

    results.update({
        "tokens_per_s": speed, "mfu": {k: v * flops / A100_BF16_FLOPS for k, v in speed.items() if v},
        "best_val_loss": {k: best_loss(v) for k, v in losses.items()},
        "final_val_loss": {k: v[-1][1] if v else None for k, v in losses.items()},
        "masked_vs_dense_step": ratio("dense_compiled", "rigl_compiled"),
        "masked_vs_dense_step_eager": ratio("dense_eager", "rigl_eager"),
        "dense_vs_nanogpt_eager": ratio("dense_eager", "nanogpt_eager"),
        "dense_vs_nanogpt_compiled": ratio("dense_compiled", "nanogpt_compiled"),
        "dense_compiled_vs_nanogpt_eager": ratio("dense_compiled", "nanogpt_eager"),
        "dense_best_val_loss": best_loss(losses.get("dense_compiled", [])),
        "nanogpt_best_val_loss": best_loss(losses.get("nanogpt_compiled", [])),
        "errors": errors})
    report(results)
    return not errors and results["gpu_tests"] in ("passed", "skipped: pytest is not installed") and all(
        verdict.startswith("equal") for verdict in results["masks"].values())


def report(results: dict[str, Any]) -> None:
    print(f"\n{results['device']}, {results['torch']}; {results['loss_steps']} steps of the loss runs")
    print(f"{'run':26s} {'tokens/s':>11s} {'ms/step':>8s} {'MFU':>6s} {'best val':>9s} {'final val':>10s}")
    for name in sorted(set(results["tokens_per_s"]) | set(results["best_val_loss"])):
        tps = results["tokens_per_s"].get(name)
        cells = [f"{tps:11,.0f}" if tps else f"{'-':>11s}",
                 f"{results['tokens'] / tps * 1e3:8.1f}" if tps else f"{'-':>8s}",
                 f"{results['mfu'][name]:6.1%}" if name in results["mfu"] else f"{'-':>6s}",
                 *(f"{results[key].get(name):{w}.4f}" if results[key].get(name) else f"{'-':>{w}s}"
                   for key, w in (("best_val_loss", 9), ("final_val_loss", 10)))]
        print(f"{name:26s} {' '.join(cells)}")
    for key, target in (("dense_vs_nanogpt_eager", ">= 1.0"), ("dense_vs_nanogpt_compiled", ">= 0.9"),
                        ("masked_vs_dense_step", "<= 1.05"), ("masked_vs_dense_step_eager", "<= 1.05")):
        value = results.get(key)
        print(f"{key}: {f'{value:.3f}' if value else 'not measured'} (target {target})")
    dense, theirs = results.get("dense_best_val_loss"), results.get("nanogpt_best_val_loss")
    if dense and theirs:
        print(f"best validation loss: ours {dense:.4f}, nanoGPT {theirs:.4f} (target: ours <= theirs + 0.02)")
    print(f"GPU tests: {results['gpu_tests']}; masks GPU vs CPU: {results['masks']}")
    for name, error in results["errors"].items():
        print(f"{name}: {error}")


def cpu_side(args: argparse.Namespace, folder: Path, results: dict[str, Any]) -> bool:
    """What runs without a GPU: the sections, our child runs, nanoGPT's on a CPU."""
    import sparsity

    for section in VARIANTS.values():
        sparsity.configure(JobSpec.from_yaml("{}", [f"sparsity={section}"]).sparsity)
    runs = {name: launch(our_task(name, TINY + overrides, steps=4, mode="train"), "cpu", folder / name, threads=1)
            for name, overrides in (("dense", []), ("rigl", [f"sparsity={VARIANTS['rigl']}"]))}
    summaries = {name: collect(process, folder / name, args.timeout) for name, process in runs.items()}
    side: dict[str, Any] = {name: s.get("error") or f"{s['steps']} steps, loss {s['train_loss']:.3f}"
                            for name, s in summaries.items()}
    checkout, results["nanogpt"] = nanogpt_checkout(args.nanogpt)
    if checkout is not None:
        run = run_nanogpt(checkout, write_nanogpt_data(folder / "nanogpt-data"), folder / "nanogpt",
                          compiled=False, steps=4, device="cpu", extra=NANOGPT_TINY, timeout=args.timeout)
        side["nanogpt"] = run.get("error") or f"validation losses {run['eval_history']}"
    results["cpu_side"] = side
    print(f"CPU side: {side}\nnanoGPT: {results['nanogpt']}")
    return not any(s.get("error") for s in summaries.values())


def write(out: Path, results: dict[str, Any]) -> None:
    """The results with the machine they ran on (bench/record.py)."""
    write_json(out, results, load_at_start=LOAD_AT_START)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nanogpt", type=Path, default=os.environ.get("NANOGPT") or None,
                        help="a nanoGPT checkout (default: $NANOGPT)")
    parser.add_argument("--loss-steps", type=int, default=1500, help="steps of the loss runs")
    parser.add_argument("--speed-steps", type=int, default=300, help="steps of the speed-only runs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run may take")
    parser.add_argument("--json", type=Path, default=None,
                        help="default: bench/results/gpu_check.json (gpu_check_cpu.json without CUDA)")
    parser.add_argument("--quick", action="store_true", help="300 loss steps, 150 speed steps (make bench)")
    parser.add_argument("--rehearse", action="store_true",
                        help="the GPU flow on this CPU with a tiny model (checks the script; measures nothing)")
    parser.add_argument("--run-one", type=Path, help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args(argv)
    if args.run_one:
        return run_one(args.run_one)
    if args.quick:
        args.loss_steps, args.speed_steps = 300, 150
    if args.rehearse:
        args.loss_steps, args.speed_steps = 6, 6
    cuda = torch.cuda.is_available()
    print(torch_build(), flush=True)
    spec = JobSpec.from_yaml(CONFIG.read_text(encoding="utf-8"), TINY if args.rehearse else [])
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (no CUDA device)", "cuda": cuda,
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "loss_steps": args.loss_steps,
        "speed_steps": args.speed_steps,
        "tokens": spec.train_input.batch_size * spec.train_input.max_sequence_length,  # a step's
        **dict.fromkeys(("gpu_tests", "masks"), "skipped: no CUDA device"),
        **dict.fromkeys(("masked_vs_dense_step", "dense_vs_nanogpt_eager", "dense_vs_nanogpt_compiled",
                         "dense_best_val_loss", "nanogpt_best_val_loss"))}
    started = time.perf_counter()
    out = args.json or RESULTS / ("gpu_check.json" if cuda and not args.rehearse else "gpu_check_cpu.json")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        if cuda or args.rehearse:
            print(f"device: {results['device']}{' (a rehearsal)' if args.rehearse else ''}", flush=True)
            ok = gpu_check(args, Path(tmp), results, REHEARSAL if args.rehearse else Plan(), out)
        else:
            print("no CUDA device: the GPU runs, GPU tests and masks comparison are skipped "
                  "(run `make gpu-check` on a machine with one); exercising the CPU side")
            ok = cpu_side(args, Path(tmp), results)
    results["wall_s"] = time.perf_counter() - started
    write(out, results)
    print(f"wrote {out} ({results['wall_s']:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
