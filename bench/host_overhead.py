"""Host time of a training step, ours against nanoGPT's, where the kernels cost almost nothing
(issue 42): on a GPU our step was bound by the host (four runs sharing one H100 each ran at
the speed of one alone), so what the host spends per step can be measured on a CPU.

The model is nanoGPT's GPU configuration (examples/nanogpt_shakespeare_gpu.yaml: 6 layers,
6 heads) made tiny (48 wide, one sequence of 16 tokens), so every op is the host's call
and dispatch, not arithmetic. Each of these takes steps in turn, in rounds, in an order that
rotates each round, so load from other processes falls on all alike; medians over rounds:

- ours, dense and each of the five algorithms at 80% (Static, GMP, SET, RigL, GraNet; their
  updates outside the timed steps: the ordinary masked step), through the loop's own step
  (training.loop._optimizer_step: batch, forward, backward with the sparsity hooks, clipping,
  optimizer step with its hooks, LR schedule) on the optimizer and fabric the loop builds;
- nanoGPT's step as its train.py takes it, on its own model.py from a checkout (``--nanogpt``
  or ``NANOGPT``; not shipped here): LR set, forward, next batch, backward, clipping, its
  AdamW (fused, as configure_optimizers makes it for CUDA), ``zero_grad(set_to_none=True)``,
  ``loss.item()`` every 10 steps (its log_interval for this configuration).

Per step: host milliseconds (the thread's CPU time, one torch thread), the ops dispatched
(non-view ATen calls: on a GPU each is a kernel launch, a fused optimizer's one for many tensors)
and the host reads of tensor values (training.host_reads: on a GPU each is a sync). Writes
bench/results/host_overhead.json.

    python bench/host_overhead.py [--quick] [--rounds N] [--nanogpt DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, not installed

from csx_config import JobSpec  # noqa: E402
from record import write_json  # noqa: E402  (bench/ is on sys.path as a script)
from training import loop  # noqa: E402
from training.build import build_run  # noqa: E402
from training.fabric import compile_run  # noqa: E402
from training.host_reads import HostReads  # noqa: E402
from training.plan import plan_job  # noqa: E402

RESULTS = REPO / "bench" / "results" / "host_overhead.json"
CONFIG = REPO / "examples" / "nanogpt_shakespeare_gpu.yaml"
WIDTH, SEQ_LEN, LAYERS, HEADS, VOCAB = 48, 16, 6, 6, 256
TINY = [f"model.hidden_size={WIDTH}", f"model.filter_size={4 * WIDTH}", "train_input.batch_size=1",
        f"train_input.max_sequence_length={SEQ_LEN}", f"model.max_position_embeddings={SEQ_LEN}",
        "eval_input.batch_size=1", f"eval_input.max_sequence_length={SEQ_LEN}",
        "runconfig.eval_steps=1", "runconfig.mlflow_experiment=", "runconfig.sparse_kernel=dense"]
NEVER = "{freq: 1000000}"  # no update in the timed steps
ALGORITHMS = {"static": "{algorithm: static, sparsity: 0.8}",
              "gmp": "{algorithm: gmp, sparsity: 0.8, update: " + NEVER + "}",
              "set": "{algorithm: set, sparsity: 0.8, update: " + NEVER + "}",
              "rigl": "{algorithm: rigl, sparsity: 0.8, update: " + NEVER + "}",
              "granet": "{algorithm: granet, sparsity: {type: cubic, init_sparsity: 0.5, "
                        "end_sparsity: 0.8, sparsity_start_step: 1000000, sparsity_end_step: "
                        "2000000, prune_every_k_steps: 1000000}, update: " + NEVER + "}"}
NANOGPT_LOG_INTERVAL = 10  # config/train_shakespeare_char.py


def our_step(algorithm: str | None, folder: Path, cpu_run: bool = False) -> Callable[[], object]:
    """The loop's step as it runs on a GPU (training.build.build_run for a CUDA device): masked
    dense, without the fabric's layers (training.build.fabric_layers), q, k and v in one matmul;
    with `cpu_run`, as a CPU run takes it (the fabric's layers, sparse_kernel dense; three
    projections)."""
    overrides = TINY + ([] if algorithm is None else [f"sparsity={ALGORITHMS[algorithm]}"])
    spec = JobSpec.from_yaml(CONFIG.read_text(encoding="utf-8"), overrides)
    run = build_run(plan_job(spec), folder, 0, torch.device("cpu"))
    run.end_step = 10 ** 9
    if cpu_run:
        compile_run(run, 1, 0, folder, None)
    else:
        run.model.use_one_qkv_matmul()
    return lambda: loop._optimizer_step(run, None)


def nanogpt_step(checkout: Path) -> Callable[[], object]:
    """nanoGPT's train.py step on its model.py, at our tiny size (its code is imported from the
    checkout, not copied)."""
    module_spec = importlib.util.spec_from_file_location("nanogpt_model", checkout / "model.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    config = module.GPTConfig(block_size=SEQ_LEN, vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS,
                              n_embd=WIDTH, dropout=0.2, bias=False)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its parameter count
        model = module.GPT(config)
        optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cuda")  # fused, as on a GPU
    data = torch.randint(0, VOCAB, (100_000,))
    state = {"iteration": 0, "batch": None}

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(data) - SEQ_LEN, (1,))
        return (torch.stack([data[i:i + SEQ_LEN] for i in starts]),
                torch.stack([data[i + 1:i + 1 + SEQ_LEN] for i in starts]))

    state["batch"] = get_batch()

    def step() -> None:
        for group in optimizer.param_groups:
            group["lr"] = 1e-3
        _, loss = model(*state["batch"])
        state["batch"] = get_batch()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["iteration"] += 1
        if state["iteration"] % NANOGPT_LOG_INTERVAL == 0:
            loss.item()

    return step


class DispatchedOps(TorchDispatchMode):
    """Counts the non-view ATen ops dispatched: each a kernel launch on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def per_step_counts(step: Callable[[], object], steps: int) -> tuple[float, float]:
    """(ops dispatched, host reads) per step, over `steps` steps."""
    with HostReads() as reads, DispatchedOps() as ops:
        for _ in range(steps):
            step()
    return ops.count / steps, len(reads.names) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--nanogpt", type=Path, default=os.environ.get("NANOGPT") or None,
                        help="a nanoGPT checkout (default: $NANOGPT)")
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="4 rounds of 10 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 4, 10
    load_at_start = os.getloadavg()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="host-overhead-") as tmp:
        steps: dict[str, Callable[[], object]] = {"dense": our_step(None, Path(tmp) / "dense")}
        for name in ALGORITHMS:
            steps[name] = our_step(name, Path(tmp) / name)
        if args.nanogpt is not None and (args.nanogpt / "model.py").exists():
            steps["nanogpt"] = nanogpt_step(args.nanogpt)
        else:
            print(f"no nanoGPT checkout ({args.nanogpt or 'NANOGPT unset'}): ours alone")
        for step in steps.values():  # warm-up: first-call allocations, lazy optimizer state
            for _ in range(3):
                step()
        times: dict[str, list[float]] = {name: [] for name in steps}
        names = list(steps)
        for round_ in range(args.rounds):  # each round in another order
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                step = steps[name]
                started = time.thread_time()
                for _ in range(args.steps):
                    step()
                times[name].append((time.thread_time() - started) / args.steps * 1e3)
        counts = {name: per_step_counts(step, NANOGPT_LOG_INTERVAL) for name, step in steps.items()}
    ms = {name: statistics.median(values) for name, values in times.items()}
    result: dict = {"torch": torch.__version__, "threads": 1, "width": WIDTH, "tokens": SEQ_LEN,
                    "rounds": args.rounds, "steps_per_round": args.steps,
                    "host_ms_per_step": ms,
                    "ops_per_step": {name: c[0] for name, c in counts.items()},
                    "host_reads_per_step": {name: c[1] for name, c in counts.items()}}
    masked = [name for name in ALGORITHMS]
    result["masked_vs_dense_ratio"] = {name: ms[name] / ms["dense"] for name in masked}
    if "nanogpt" in ms:
        result["dense_vs_nanogpt_ratio"] = ms["dense"] / ms["nanogpt"]
    print(f"host time per step, {WIDTH} wide, {SEQ_LEN} tokens, 1 thread, median of "
          f"{args.rounds} rounds of {args.steps} steps")
    print(f"{'step':8s} {'ms':>8s} {'x dense':>8s} {'x nanoGPT':>10s} {'ops':>6s} {'reads':>6s}")
    for name in steps:
        versus = f"{ms[name] / ms['nanogpt']:10.3f}" if "nanogpt" in ms else f"{'-':>10s}"
        print(f"{name:8s} {ms[name]:8.3f} {ms[name] / ms['dense']:8.3f} {versus} "
              f"{counts[name][0]:6.0f} {counts[name][1]:6.2f}")
    write_json(args.json, result, load_at_start=load_at_start)  # with the machine (bench/record.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
