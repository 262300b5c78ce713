"""Tokens/s of training at 90% sparsity through the fabric vs masked dense, on two models.

Models: the study's (models/config.py preset `tiny`: 2 layers, hidden 64, 16 x 128 tokens) and
a wider proxy of it (hidden 512, feed-forward 1280, same depth, batch and sequence). For each,
both runs start from the same weights and the same RigL masks (90%, an update every 10 steps,
so update steps with their dense weight gradient are timed too) and see the same batches; the
masked dense run is what training without the simulator does (sparsity hooks on a dense model),
the fabric run is the same model after ``simulator.compile`` (with the optimizer: the CSR
layers' weights are values, the optimizer steps their non-zeros), which picks CSR or dense per
layer by the measured crossover rule. The runs are stepped alternately so load from other
processes hits both alike. With --before COMMIT, a third run goes through that commit's
simulator (loaded as bench/csr_linear.py does), stepped in turn with the other two: a
before/after of the fabric in the same run. With one thread (the default) a step's time is the
calling thread's CPU time, which other processes on a shared machine disturb far less than wall
time. Also prints the final losses, the kernel decisions, the CSR rebuild times and the cost
model's projected CS-2 step. Target (issue 35): fabric >= 2.5x the masked dense tokens/s on the
wide proxy.

The ceiling beside it (Amdahl's law, measured): each masked layer's forward+backward is timed
alone, masked dense and CSR (over the weights' values, as the fabric run's ordinary steps),
at the run's token count. Their masked dense share of the masked
dense step bounds the ratio any kernel could reach (the layers taking no time at all); with the
layers at the FLOP limit (masked dense time x density: sparse kernels as fast per useful FLOP as
the dense GEMM) it gives what a perfect kernel would reach; swapping in the CSR times predicts
the fabric step, which checks the isolated timings against the measured ratio.
Writes bench/results/fabric_training.json.

    python bench/fabric_training.py [--quick] [--steps N] [--threads T] [--before COMMIT]
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

import simulator  # noqa: E402
from simulator.csr import weight_values  # noqa: E402
from simulator.native import load_kernels  # noqa: E402
import sparsity  # noqa: E402
from models.config import preset_config  # noqa: E402
from models.transformer import build_model  # noqa: E402

from csr_linear import (csr_step, dense_step,  # noqa: E402  (bench/ is on sys.path as a script)
                        load_before)
from record import write_json  # noqa: E402
from roofline import fastest_ms  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "fabric_training.json"
MODELS = {"study": preset_config("tiny"),
          "wide": preset_config("tiny", hidden_size=512, filter_size=1280)}
BATCH, SEQ_LEN, SPARSITY, UPDATE_FREQ = 16, 128, 0.9, 10
TARGET_RATIO = 2.5
TARGET_MODEL = "wide"


def batches(steps: int, batch: int, seq_len: int, vocab: int):
    """A fixed, learnable token stream: noisy arithmetic sequences (no download)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        stride = torch.randint(1, 4, (batch, 1), generator=gen)
        seq = (start + stride * torch.arange(seq_len + 1)) % vocab
        noise = torch.rand(seq.shape, generator=gen) < 0.05
        seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=gen), seq)
        yield seq[:, :-1], seq[:, 1:]


def clock() -> float:
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


class Run:
    """One model + RigL + AdamW, masked dense or through a fabric (`compile`: this tree's
    ``simulator.compile``, its weights as values, or an older commit's)."""

    def __init__(self, model_name: str, compile=None) -> None:
        self.fabric = compile is simulator.compile
        self.model = build_model(MODELS[model_name], seed=0)
        self.algorithm = sparsity.RigL(sparsity=SPARSITY, update={"freq": UPDATE_FREQ},
                                       drop_fraction=0.3, seed=0)
        self.algorithm.apply(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3, fused=True)
        self.algorithm.apply(self.optimizer)
        if self.fabric:  # weights as values: the optimizer steps the CSR layers' non-zeros
            compile(self.model, self.algorithm, tokens=BATCH * SEQ_LEN, optimizer=self.optimizer)
        elif compile is not None:
            compile(self.model, self.algorithm, tokens=BATCH * SEQ_LEN)
        self.losses: list[float] = []
        self.timed_s = 0.0

    def step(self, x: torch.Tensor, y: torch.Tensor, timed: bool) -> None:
        start = clock()
        _, loss = self.model(x, y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        if timed:
            self.timed_s += clock() - start
        self.losses.append(loss.item())

    def summary(self, steps: int) -> dict:
        result = {"tokens_per_s": steps * BATCH * SEQ_LEN / self.timed_s,
                  "step_ms": self.timed_s / steps * 1e3,
                  "first_loss": self.losses[0], "final_loss": self.losses[-1],
                  "losses": self.losses}
        if self.fabric:
            result["decisions"] = [
                {"name": d.name, "shape": d.shape, "density": d.density, "kernel": d.kernel,
                 "why": d.why, "rebuilds": d.rebuilds, "last_rebuild_ms": d.last_rebuild_ms,
                 "changed_rows": d.changed_rows}
                for d in simulator.decisions(self.model)]
            layers = simulator.layers_from_model(self.model, seq_tokens=SEQ_LEN)
            projection = simulator.project_step(layers, tokens=BATCH * SEQ_LEN,
                                                cluster=simulator.WaferScaleCluster(1))
            result["cs2_projection"] = projection.metrics()
        return result


def layer_fwd_bwd_ms(layer: simulator.CSRLinear, tokens: int, reps: int = 5) -> dict[str, float]:
    """Fastest forward+backward (ms) of one masked layer alone, as the masked dense run
    computes it (F.linear over W * mask) and in CSR over the weight's values; the two
    alternate."""
    gen = torch.Generator().manual_seed(0)
    mask = layer.weight_mask
    weight = layer.weight.detach().clone().requires_grad_(True)
    x = torch.randn(tokens, layer.in_features, generator=gen).requires_grad_(True)
    upstream = torch.randn(tokens, layer.out_features, generator=gen)
    structure = simulator.CSRStructure.from_mask(mask)
    values = weight_values(None, structure, weight.detach()).requires_grad_(True)
    return fastest_ms({"masked_dense": lambda: dense_step(x, weight, mask, upstream),
                       "csr": lambda: csr_step(x, values, structure, upstream, "auto")}, reps)


def amdahl(dense: dict, fabric_model: torch.nn.Module) -> dict:
    """How far the masked layers alone can take the ratio (see the module docstring)."""
    layers = [m for m in fabric_model.modules() if isinstance(m, simulator.CSRLinear)]
    times = [layer_fwd_bwd_ms(layer, BATCH * SEQ_LEN) for layer in layers]
    layers_dense_ms = sum(t["masked_dense"] for t in times)
    layers_flop_limit_ms = sum(t["masked_dense"] * layer.decision.density
                               for t, layer in zip(times, layers))
    layers_fabric_ms = sum(t[layer.decision.kernel.replace("dense", "masked_dense")]
                           for t, layer in zip(times, layers))
    rest_ms = dense["step_ms"] - layers_dense_ms
    return {"masked_layers_dense_ms": layers_dense_ms, "masked_layers_fabric_ms": layers_fabric_ms,
            "masked_layers_share": layers_dense_ms / dense["step_ms"],
            "ceiling_ratio": dense["step_ms"] / rest_ms if rest_ms > 0 else math.inf,
            "flop_limit_ratio": dense["step_ms"] / (rest_ms + layers_flop_limit_ms),
            "predicted_ratio": dense["step_ms"] / (rest_ms + layers_fabric_ms)}


def train_both(model_name: str, steps: int, warmup: int,
               before_compile=None) -> tuple[dict, dict, dict | None]:
    """Masked dense, fabric and (with `before_compile`) the older fabric, stepped in turn
    (the order rotating every step); their summaries."""
    dense, fabric = Run(model_name), Run(model_name, simulator.compile)
    runs = [dense, fabric]
    if before_compile is not None:
        runs.append(Run(model_name, before_compile))
    vocab = MODELS[model_name].vocab_size
    for step, (x, y) in enumerate(batches(warmup + steps, BATCH, SEQ_LEN, vocab)):
        for i in range(len(runs)):
            runs[(step + i) % len(runs)].step(x, y, timed=step >= warmup)
    dense_summary = dense.summary(steps)
    before = runs[2].summary(steps) if before_compile is not None else None
    return (dense_summary, {**fabric.summary(steps), "amdahl": amdahl(dense_summary, fabric.model)},
            before)


def report(model_name: str, dense: dict, fabric: dict, before: dict | None, steps: int) -> float:
    ratio = fabric["tokens_per_s"] / dense["tokens_per_s"]
    config = MODELS[model_name]
    print(f"== {model_name}: hidden {config.hidden_size}, feed-forward {config.filter_size}, "
          f"{config.num_hidden_layers} layers, batch {BATCH} x {SEQ_LEN}, RigL {SPARSITY:.0%} "
          f"(update every {UPDATE_FREQ}), {steps} timed steps, {torch.get_num_threads()} thread(s)")
    named = [("masked dense", dense), ("fabric (CSR)", fabric)]
    named += [("fabric before", before)] if before is not None else []
    for name, run in named:
        print(f"{name}: {run['tokens_per_s']:9.0f} tokens/s ({run['step_ms']:.1f} ms/step), "
              f"loss {run['first_loss']:.3f} -> {run['final_loss']:.3f}")
    target = (f" (target {TARGET_RATIO:g}x: {'ok' if ratio >= TARGET_RATIO else 'MISS'})"
              if model_name == TARGET_MODEL else "")
    print(f"fabric / masked dense tokens/s: {ratio:.2f}x{target}; max |loss difference| "
          f"{max(abs(a - b) for a, b in zip(dense['losses'], fabric['losses'])):.2e}")
    if before is not None:
        print(f"fabric before / masked dense tokens/s: "
              f"{before['tokens_per_s'] / dense['tokens_per_s']:.2f}x; fabric / fabric before: "
              f"{fabric['tokens_per_s'] / before['tokens_per_s']:.2f}x")
    for d in fabric["decisions"]:
        rebuilt = (f" rebuilds {d['rebuilds']} (last {d['last_rebuild_ms']:.2f} ms, "
                   f"{d['changed_rows'] / d['shape'][0]:.0%} of rows changed)"
                   if d["kernel"] == "csr" else "")
        print(f"  {d['name']:28s} {str(d['shape']):12s} density {d['density']:.3f} "
              f"{d['kernel']:5s}{rebuilt}")
    bound = fabric["amdahl"]
    print(f"masked layers alone (masked dense): {bound['masked_layers_dense_ms']:.1f} ms, "
          f"{bound['masked_layers_share']:.0%} of the masked dense step. Ratio with those layers "
          f"free: {bound['ceiling_ratio']:.2f}x; at the FLOP limit: "
          f"{bound['flop_limit_ratio']:.2f}x; predicted from their CSR/dense times alone: "
          f"{bound['predicted_ratio']:.2f}x (measured {ratio:.2f}x)")
    proj = fabric["cs2_projection"]
    print(f"projected CS-2 step from the live masks: {proj['perf/sim_step_ms']:.3f} ms, "
          f"speed-up vs dense {proj['perf/speedup_vs_dense']:.2f}x")
    if not all(math.isfinite(v) for v in (dense["final_loss"], fabric["final_loss"])):
        raise SystemExit("non-finite loss")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: study,wide")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--before", default=None,
                        help="git commit whose simulator trains side by side (a before/after)")
    args = parser.parse_args()
    load_at_start = os.getloadavg()  # a shared machine: the runs' neighbours, recorded
    before_compile = None
    if args.before:
        load_before(args.before)
        before_compile = importlib.import_module("simulator_before.layers").compile_model
    torch.set_num_threads(args.threads)
    steps = args.steps or (10 if args.quick else 30)
    warmup = 2
    results, ratios = {}, {}
    for model_name in args.models.split(","):
        dense, fabric, before = train_both(model_name, steps, warmup, before_compile)
        ratios[model_name] = report(model_name, dense, fabric, before, steps)
        results[model_name] = {"masked_dense": dense, "fabric": fabric,
                               "tokens_per_s_ratio": ratios[model_name]}
        if before is not None:
            results[model_name].update({
                "fabric_before": before,
                "before_tokens_per_s_ratio": before["tokens_per_s"] / dense["tokens_per_s"]})
    write_json(args.out, {
        "steps": steps, "threads": torch.get_num_threads(), "before_commit": args.before,
        "clock": "thread CPU time" if torch.get_num_threads() == 1 else "wall",
        "batch": BATCH, "seq_len": SEQ_LEN, "sparsity": SPARSITY, "update_freq": UPDATE_FREQ,
        **{f"{name}_tokens_per_s_ratio": ratio for name, ratio in ratios.items()},
        **{f"{name}_{bound}": results[name]["fabric"]["amdahl"][bound]
           for name in results for bound in ("ceiling_ratio", "flop_limit_ratio")},
        "target_ratio": TARGET_RATIO,
        "meets_target": (ratios[TARGET_MODEL] >= TARGET_RATIO if TARGET_MODEL in ratios
                         else None),
        "models": results}, load_at_start=load_at_start, kernels=load_kernels())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
