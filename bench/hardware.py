"""Hardware per simulated system (issue 31): what the worker group's CPUs buy, and its start-up
against Ray Train's TorchTrainer.

On one local Ray runtime holding this machine's cores (one `csx` system per core):

1. Threads: tokens/s of one system with 1 CPU (torch thread) against the default, which grants
   it every core of the cluster (`cpus_per_csx` unset), on a dense model of hidden 256
   (target: >= 1.6x with 2 cores), beside what a 512x512 matmul loop gains from a second
   thread at the same time (the machine's ceiling while others use its cores), with OpenMP
   threads spinning (ACTIVE) and waiting passively (PASSIVE, the workers' default).
2. Two systems x 1 thread against one system x 2 threads, same global batch.
3. Start-up, submit -> first step: the job through the worker group (placement group, actor,
   model, first step) against training in the calling process as `csx run --num_csx 1` did
   before it went through the group, plus the cold `ray.init` a fresh `csx run` pays.
4. Ray Train against the actor group, both with 2 workers of 1 CPU and one `csx` each and a
   trivial loop: time to the loop's first line, to the end, and per progress report
   (`ray.train.report` against our relay).

The machine is shared with other work, so every number is from a busy machine; ratios are
taken within one run. Writes bench/results/hardware.json.

    python bench/hardware.py [--quick] [--steps N] [--rounds R] [--hidden 256] [--skip-ray-train]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import ray  # noqa: E402  (after the repo is importable)
import ray.cloudpickle  # noqa: E402

from csx_config import JobSpec  # noqa: E402
from record import write_json  # noqa: E402  (bench/ is on sys.path as a script)
from training.plan import plan_job  # noqa: E402
from workers.hardware import usable_cores  # noqa: E402
from workers.runner import connect_ray, start_job  # noqa: E402

# The trivial loops below run inside Ray workers, which cannot import this script by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SPEC = """
train_input: {batch_size: 8, max_sequence_length: 128}
model: {preset: tiny, hidden_size: %(hidden)d, num_hidden_layers: 4, num_heads: 8,
        filter_size: %(filter)d, max_position_embeddings: 128}
optimizer: {optimizer_type: AdamW, learning_rate: 1.0e-4}
runconfig: {max_steps: %(steps)d, log_steps: 1, seed: 0, mlflow_experiment: ""}
"""
REPORTS = 5


def spec_for(hidden: int, steps: int, cpus: int | None) -> JobSpec:
    spec = JobSpec.from_yaml(SPEC % {"hidden": hidden, "filter": 4 * hidden, "steps": steps})
    spec.runconfig.cpus_per_csx = cpus
    return spec


CEILING = """
import sys, time, torch
a = torch.randn(512, 512)
rates = []
for threads in (1, 2, 1, 2):
    torch.set_num_threads(threads)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < 1.5:
        a @ a
        done += 1
    rates.append(done / (time.perf_counter() - started))
print((rates[1] + rates[3]) / (rates[0] + rates[2]))
"""


def thread_ceiling(wait_policy: str) -> float:
    """What a second torch thread gains a 512x512 matmul loop right now (other processes share
    the cores), in a fresh process whose OpenMP threads wait `wait_policy` (read at load)."""
    out = subprocess.run([sys.executable, "-c", CEILING], capture_output=True, text=True,
                         env={**os.environ, "OMP_WAIT_POLICY": wait_policy}, check=True)
    return float(out.stdout.strip())


def timed_job(spec: JobSpec, num_csx: int, folder: Path) -> dict[str, Any]:
    """tokens/s of a job through the worker group and its submit -> first step time."""
    first: list[float] = []
    started = time.perf_counter()
    handle = start_job(plan_job(spec, num_csx), model_dir=str(folder), tracking=False,
                       progress=lambda event: first or first.append(time.perf_counter()))
    summary = handle.wait()
    return {"tokens_per_s": summary["tokens_per_s"], "first_step_s": first[0] - started,
            "threads": [worker["threads"] for worker in summary["workers"]]}


def in_process_first_step(spec: JobSpec, folder: Path) -> float:
    """Submit -> first step of the loop in this process (the old `csx run --num_csx 1`)."""
    from training.loop import train

    first: list[float] = []
    started = time.perf_counter()
    train(plan_job(spec), model_dir=str(folder), progress=lambda event: first or first.append(
        time.perf_counter()))
    return first[0] - started


def trivial_group_loop(plan: Any, *, progress: Any, rank: int, **_: Any) -> dict[str, float]:
    """The actor group's side of item 4: the loop's first line, then REPORTS reports."""
    entered = time.time()
    report_s = 0.0
    for step in range(REPORTS):
        before = time.perf_counter()
        if progress is not None:
            progress({"step": step})
        report_s += time.perf_counter() - before
    return {"entered": entered, "report_s": report_s / REPORTS if rank == 0 else 0.0}


def actor_group_startup(folder: Path) -> dict[str, float]:
    spec = JobSpec.from_yaml("train_input: {batch_size: 2}\n"
                             "runconfig: {cpus_per_csx: 1, mlflow_experiment: ''}\n")
    started = time.time()
    handle = start_job(plan_job(spec, 2), model_dir=str(folder), tracking=False,
                       train_fn=trivial_group_loop, progress=lambda event: None)
    summary = handle.wait()
    return {"first_line_s": summary["entered"] - started, "total_s": time.time() - started,
            "per_report_s": summary["report_s"]}


def ray_train_startup(folder: Path) -> dict[str, float]:
    import ray.train
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    timings = folder / "rank0.json"  # the workers run on this machine

    def loop(config: dict[str, Any]) -> None:
        entered = time.time()
        report_s = 0.0
        for step in range(REPORTS):
            before = time.perf_counter()
            ray.train.report({"step": step})
            report_s += time.perf_counter() - before
        if ray.train.get_context().get_world_rank() == 0:
            Path(config["timings"]).write_text(json.dumps(
                {"entered": entered, "report_s": report_s / REPORTS}))

    folder.mkdir(parents=True, exist_ok=True)
    trainer = TorchTrainer(loop, train_loop_config={"timings": str(timings)},
                           scaling_config=ScalingConfig(
                               num_workers=2, resources_per_worker={"CPU": 1, "csx": 1},
                               placement_strategy="PACK"),
                           run_config=RunConfig(storage_path=str(folder), name="startup"))
    started = time.time()
    trainer.fit()
    total = time.time() - started
    measured = json.loads(timings.read_text())
    return {"first_line_s": measured["entered"] - started, "total_s": total,
            "per_report_s": measured["report_s"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--skip-ray-train", action="store_true")
    parser.add_argument("--quick", action="store_true", help="4 steps, one round (make bench)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "hardware.json")
    args = parser.parse_args(argv)
    load_at_start = os.getloadavg()
    if args.quick:
        args.steps, args.rounds = 4, 1
    # Ray Train's fastest setting measured here (docs/design.md §6); read by its controller.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    cores = usable_cores()
    results: dict[str, Any] = {"cores": cores, "hidden": args.hidden, "steps": args.steps,
                               "note": "a shared, busy 2-core machine: compare within a run"}
    with tempfile.TemporaryDirectory(prefix="hardware-") as tmp:
        folder = Path(tmp)
        cold = time.perf_counter()
        connect_ray(systems=cores)
        results["ray_init_s"] = time.perf_counter() - cold
        print(f"ray.init (cold, what a fresh `csx run` pays): {results['ray_init_s']:.1f} s")

        runs = {
            "1 system x 1 thread": (spec_for(args.hidden, args.steps, 1), 1),
            "1 system x default": (spec_for(args.hidden, args.steps, None), 1),
            "2 systems x default": (spec_for(args.hidden, args.steps, None), 2),
        }
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
        for round_index in range(args.rounds):
            # Rotated order: load from other processes hits every configuration alike.
            names = list(runs)[round_index % len(runs):] + list(runs)[:round_index % len(runs)]
            for name in names:
                spec, num_csx = runs[name]
                rounds[name].append(timed_job(spec, num_csx,
                                              folder / f"{name.replace(' ', '_')}_{round_index}"))
                print(f"{name}: {rounds[name][-1]}")
        for name, measured in rounds.items():  # best of the rounds: the least disturbed
            results[name] = {**max(measured, key=lambda m: m["tokens_per_s"]),
                             "all_tokens_per_s": [m["tokens_per_s"] for m in measured]}
        for policy in ("ACTIVE", "PASSIVE"):  # the workers' default is PASSIVE (runner.py)
            results[f"machine_thread_ceiling_{policy.lower()}"] = ceiling = thread_ceiling(policy)
            print(f"machine ceiling, matmuls/s with 2 threads vs 1, OpenMP {policy}: "
                  f"{ceiling:.2f}x")
        one, default = results["1 system x 1 thread"], results["1 system x default"]
        results["threads_speedup"] = default["tokens_per_s"] / one["tokens_per_s"]
        results["two_systems_vs_one_two_threads"] = (
            results["2 systems x default"]["tokens_per_s"] / default["tokens_per_s"])
        results["in_process_first_step_s"] = in_process_first_step(
            spec_for(args.hidden, 2, None), folder / "in_process")
        print(f"1 system, {default['threads']} threads vs 1 thread: "
              f"{results['threads_speedup']:.2f}x tokens/s (target >= 1.6)")
        print(f"2 systems x 1 thread vs 1 system x 2 threads: "
              f"{results['two_systems_vs_one_two_threads']:.2f}x tokens/s")
        print(f"submit -> first step: worker group {default['first_step_s']:.1f} s (warm Ray), "
              f"in process (old csx run --num_csx 1) {results['in_process_first_step_s']:.1f} s")

        results["actor_group"] = actor_group_startup(folder / "group")
        print(f"actor group, 2 workers, trivial loop: {results['actor_group']}")
        if not args.skip_ray_train:
            results["ray_train"] = ray_train_startup(folder / "ray_train")
            print(f"Ray Train TorchTrainer, 2 workers, trivial loop: {results['ray_train']}")
    write_json(args.out, results, load_at_start=load_at_start)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
