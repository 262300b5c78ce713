"""Roofline of the fabric's CSR kernels: useful GFLOP/s of each one against its bound.

Measured on this machine, per weight shape, token count, sparsity and thread count:
  dense GEMM   torch.mm for the three products of a linear layer (X Wᵀ, dY W, dYᵀ X); its
               GFLOP/s is the compute bound (the rate this CPU reaches per multiply-add)
  forward      Y = X Wᵀ through the CSR kernels (activation packing included)
  input grad   dX = dY W through the CSR of Wᵀ (packing of dY included)
  weight grad  dW at the non-zeros only (sampled dense-dense product)
Useful FLOPs are 2 · tokens · nnz per kernel. Bounds, as times:
  compute  useful FLOPs at the dense GEMM's rate
  memory   the least traffic the kernel needs (activations in and out once, the CSR pattern and
           values once) at the measured DRAM copy bandwidth
  L2       every non-zero streaming its tokens' activations (tokens · 4 bytes) at the measured
           L2 read bandwidth (per core, times the threads): the ceiling of a kernel that loads
           one activation vector per vector FMA, as a sparse row times a dense tile does when
           the tile lives in L2 (0.5 FLOP per byte)
"of bound" is the largest of the three over the measured time (1.0 = at the roofline).
The kernels' own ceiling, measured: each case also runs the same three calls on the same pattern
with every column index folded into the first FOLD_COLUMNS columns, so every activation the
kernels read sits in L1 and nothing else changes (non-zeros per row, packing, outputs). No
tiling can make the real pattern faster than that. Forward + backward of the three calls, real
and folded, against the masked dense layer (F.linear over W * mask, forward + backward) gives the
ratio each reaches: the folded one is the most this kernel design can give (issue 35's
targets: 4.5x at 90%, 10x at 97%).
The variant the fabric runs: each case also times the forward and backward (weights as values)
on the kernel variant this machine's calibration chose for the shape and density
(simulator.crossover.machine_calibration), against the sum of the three kernels' bounds: how far
the machine's choice is from its own roofline (bench/run_all.py tabulates it per shape).
With --before COMMIT, that commit's kernels (loaded as bench/csr_linear.py does) run interleaved
with these in the same cases, and each row also holds their time and fractions (a before/after
measured side by side).
Times are the fastest of --reps runs, all functions of a case interleaved so that load from
other processes hits them alike; with one thread they are the calling thread's CPU time
(everything runs on it), which a machine shared with other work disturbs far less than wall
time; with more threads, wall time.
Writes bench/results/roofline.json, with the machine (bench/record.py).

    python bench/roofline.py [--quick] [--threads 1,2] [--before COMMIT]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from simulator.crossover import machine_calibration  # noqa: E402
from simulator.csr import (CSRStructure, native_kernel_calls, native_variant_calls,  # noqa: E402
                           weight_values)
from simulator.native import ARCH_ENV, NATIVE_ARCH, load_kernels  # noqa: E402

from csr_linear import dense_step, load_before  # noqa: E402  (bench/ is on sys.path as a script)
from record import write_json  # noqa: E402

SHAPES = [(1024, 1024), (4096, 1024)]
TOKENS = [512, 2048]
SPARSITIES = [0.9, 0.97]
KERNELS = ("forward", "input_grad", "weight_grad")
BYTES = 4  # float32
L2_PROBE_BYTES = 512 * 1024  # past any L1, within any L2 of a machine with AVX2
FOLD_COLUMNS = 8  # 8 activation rows of a 64-token block: 2 KiB, in any L1
TARGETS = {0.9: 4.5, 0.97: 10.0}  # issue 35 (stretch 6x / 14x)
RESULTS = Path(__file__).resolve().parent / "results" / "roofline.json"


def clock() -> float:
    """CPU time of this thread when torch runs on it alone, else wall time (seconds)."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def fastest_ms(fns: dict, reps: int) -> dict[str, float]:
    """Fastest ms per function, interleaved so that load from other processes hits all alike."""
    for fn in fns.values():
        fn()
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = clock()
            fn()
            samples[name].append((clock() - start) * 1e3)
    return {name: min(v) for name, v in samples.items()}


def dram_gb_s(reps: int) -> float:
    """DRAM copy bandwidth: bytes read + written per second copying 128 MiB."""
    src = torch.empty(1 << 25)
    src.uniform_()
    dst = torch.empty_like(src)
    copy_ms = fastest_ms({"copy": lambda: dst.copy_(src)}, reps)["copy"]
    return 2 * src.numel() * BYTES / copy_ms / 1e6


def traffic_bytes(kernel: str, out_f: int, in_f: int, tokens: int, nnz: int) -> int:
    """Least bytes a kernel moves to or from memory: activations once each way, the CSR once."""
    pattern = nnz * 4 + (out_f + 1) * 4
    if kernel == "forward":       # read X, the values and the pattern; write Y
        return (tokens * in_f + tokens * out_f + nnz) * BYTES + pattern
    if kernel == "input_grad":    # read dY, the values and the pattern of Wᵀ; write dX
        return (tokens * out_f + tokens * in_f + nnz) * BYTES + (nnz + in_f + 1) * 4
    return (tokens * out_f + tokens * in_f + nnz) * BYTES + pattern  # read dY, X; write dW[nnz]


def masked_dense_ms(weight, x, grad_y, mask, reps) -> float:
    """Forward + backward of the masked dense layer (what training without the fabric runs)."""
    weight, x = weight.clone().requires_grad_(True), x.clone().requires_grad_(True)
    step = lambda: dense_step(x, weight, mask, grad_y)  # noqa: E731
    return fastest_ms({"masked_dense": step}, reps)["masked_dense"]


def bench_shape(out_f, in_f, tokens, threads, reps, bandwidth, l2_gb_s, kernels,
                before=None) -> tuple[list[dict], list[dict]]:
    """Per-kernel rows and per-sparsity forward + backward cases of one shape."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_f, in_f, generator=gen)
    x = torch.randn(tokens, in_f, generator=gen)
    grad_y = torch.randn(tokens, out_f, generator=gen)
    dense_flops = 2 * tokens * out_f * in_f
    dense = fastest_ms({"forward": lambda: x.mm(weight.t()),
                       "input_grad": lambda: grad_y.mm(weight),
                       "weight_grad": lambda: grad_y.t().mm(x)}, reps)
    dense_gflops = {k: dense_flops / ms / 1e6 for k, ms in dense.items()}
    rows, cases = [], []
    calibration = machine_calibration()
    for sparsity in SPARSITIES:
        mask = torch.rand(out_f, in_f, generator=gen) >= sparsity
        structure = CSRStructure.from_mask(mask)
        nnz = structure.nnz
        folded = dataclasses.replace(structure, cols=structure.cols % FOLD_COLUMNS,
                                     cols_t=structure.cols_t % FOLD_COLUMNS)
        calls = native_kernel_calls(kernels, structure, weight, x, grad_y)
        variant = calibration.variant_for(out_f, in_f, 1.0 - sparsity)
        variant_kernels = load_kernels(variant)
        calls.update({f"variant_{name}": fn for name, fn in native_variant_calls(
            variant_kernels, structure, weight_values(variant_kernels, structure, weight), x,
            grad_y, variant).items()})
        calls.update({f"folded_{name}": fn for name, fn in
                      native_kernel_calls(kernels, folded, weight, x, grad_y).items()})
        if before is not None:
            old_kernels = before.load_kernels()
            old_calls = before.native_kernel_calls(
                old_kernels, before.CSRStructure.from_mask(mask), weight, x, grad_y)
            calls.update({f"before_{name}": fn for name, fn in old_calls.items()})
        times = fastest_ms(calls, reps)
        for kernel in KERNELS:
            flops = 2 * tokens * nnz
            gflops = flops / times[kernel] / 1e6
            traffic = traffic_bytes(kernel, out_f, in_f, tokens, nnz)
            compute_ms = flops / dense_gflops[kernel] / 1e6
            memory_ms = traffic / bandwidth / 1e6
            l2_ms = nnz * tokens * BYTES / (l2_gb_s * threads) / 1e6
            bounds = {"compute": compute_ms, "memory": memory_ms, "l2": l2_ms}
            bound = max(bounds, key=bounds.get)
            bound_ms = bounds[bound]
            rows.append({
                "shape": [out_f, in_f], "tokens": tokens, "threads": threads,
                "sparsity": sparsity, "nnz": nnz, "kernel": kernel,
                "dense_gemm_ms": dense[kernel], "dense_gemm_gflops": dense_gflops[kernel],
                "csr_ms": times[kernel], "csr_gflops": gflops,
                "fraction_of_dense_rate": gflops / dense_gflops[kernel],
                "traffic_mb": traffic / 1e6, "compute_bound_ms": compute_ms,
                "memory_bound_ms": memory_ms, "l2_bound_ms": l2_ms, "bound_ms": bound_ms,
                "bound": bound,
                "fraction_of_bound": bound_ms / times[kernel],
                "speedup_vs_dense_gemm": dense[kernel] / times[kernel],
                "l1_folded_ms": times[f"folded_{kernel}"],
                "fraction_of_l1_folded": times[f"folded_{kernel}"] / times[kernel]})
            if before is not None:
                old_ms = times[f"before_{kernel}"]
                rows[-1].update({"before_csr_ms": old_ms, "before_csr_gflops": flops / old_ms / 1e6,
                                 "before_fraction_of_dense_rate":
                                     flops / old_ms / 1e6 / dense_gflops[kernel],
                                 "before_fraction_of_bound": bound_ms / old_ms})
        masked_ms = masked_dense_ms(weight, x, grad_y, mask, reps)
        kernels_ms = sum(times[kernel] for kernel in KERNELS)
        folded_ms = sum(times[f"folded_{kernel}"] for kernel in KERNELS)
        variant_ms = times["variant_forward"] + times["variant_backward"]
        bound_ms = sum(row["bound_ms"] for row in rows[-len(KERNELS):])
        cases.append({"shape": [out_f, in_f], "tokens": tokens, "threads": threads,
                      "sparsity": sparsity, "masked_dense_ms": masked_ms,
                      "kernels_ms": kernels_ms, "l1_folded_ms": folded_ms,
                      "ratio": masked_ms / kernels_ms, "l1_folded_ratio": masked_ms / folded_ms,
                      "variant": variant.name, "variant_forward_ms": times["variant_forward"],
                      "variant_backward_ms": times["variant_backward"], "variant_ms": variant_ms,
                      "bound_ms": bound_ms, "variant_fraction_of_bound": bound_ms / variant_ms,
                      "variant_ratio": masked_ms / variant_ms})
    return rows, cases


def print_rows(rows: list[dict]) -> None:
    print(f"{'t':>2} {'shape':>10} {'tok':>5} {'sp':>5} {'kernel':>11} {'dense GF/s':>10} "
          f"{'csr GF/s':>9} {'of dense':>8} {'MB':>6} {'bound ms':>9} {'csr ms':>8} "
          f"{'bound':>7} {'of bound':>8} {'x dense':>7}")
    for r in rows:
        print(f"{r['threads']:>2} {r['shape'][0]:>5}x{r['shape'][1]:<4} {r['tokens']:>5} "
              f"{r['sparsity']:>5.2f} {r['kernel']:>11} {r['dense_gemm_gflops']:>10.1f} "
              f"{r['csr_gflops']:>9.1f} {r['fraction_of_dense_rate']:>8.2f} "
              f"{r['traffic_mb']:>6.1f} {r['bound_ms']:>9.3f} {r['csr_ms']:>8.3f} "
              f"{r['bound']:>7} {r['fraction_of_bound']:>8.2f} "
              f"{r['speedup_vs_dense_gemm']:>7.2f}"
              + (f" | before {r['before_csr_ms']:8.3f} ms {r['before_csr_gflops']:6.1f} GF/s "
                 f"{r['before_fraction_of_dense_rate']:.2f} of dense"
                 if "before_csr_ms" in r else ""), flush=True)


def print_cases(cases: list[dict]) -> None:
    for c in cases:
        print(f"   {c['shape'][0]}x{c['shape'][1]} {c['tokens']} tokens s={c['sparsity']:.2f}: "
              f"masked dense {c['masked_dense_ms']:.2f} ms; the three kernels "
              f"{c['kernels_ms']:.2f} ms = {c['ratio']:.2f}x; every activation in L1 "
              f"{c['l1_folded_ms']:.2f} ms = {c['l1_folded_ratio']:.2f}x; chosen variant "
              f"{c['variant']}: {c['variant_ms']:.2f} ms = {c['variant_ratio']:.2f}x, "
              f"{c['variant_fraction_of_bound']:.2f} of the {c['bound_ms']:.2f} ms roofline",
              flush=True)


def summary(rows: list[dict], cases: list[dict]) -> dict:
    """Per kernel: the lowest and median fraction of the dense GEMM's rate and of the bound;
    per target sparsity: the lowest forward + backward ratio, real and L1-folded."""
    out = {}
    for sparsity, target in TARGETS.items():
        mine = [c for c in cases if c["sparsity"] == sparsity]
        if mine:
            out[f"min_kernels_ratio_at_{sparsity}"] = min(c["ratio"] for c in mine)
            out[f"min_l1_folded_ratio_at_{sparsity}"] = min(c["l1_folded_ratio"] for c in mine)
            out[f"min_variant_ratio_at_{sparsity}"] = min(c["variant_ratio"] for c in mine)
            out[f"min_variant_fraction_of_bound_at_{sparsity}"] = min(
                c["variant_fraction_of_bound"] for c in mine)
            out[f"target_at_{sparsity}"] = target
    for kernel in KERNELS:
        mine = [r for r in rows if r["kernel"] == kernel]
        dense_fraction = sorted(r["fraction_of_dense_rate"] for r in mine)
        bound_fraction = sorted(r["fraction_of_bound"] for r in mine)
        out[f"{kernel}_min_fraction_of_dense_rate"] = dense_fraction[0]
        out[f"{kernel}_median_fraction_of_dense_rate"] = dense_fraction[len(mine) // 2]
        out[f"{kernel}_median_fraction_of_bound"] = bound_fraction[len(mine) // 2]
        if mine and "before_csr_ms" in mine[0]:
            before_fraction = sorted(r["before_fraction_of_dense_rate"] for r in mine)
            out[f"{kernel}_before_median_fraction_of_dense_rate"] = before_fraction[len(mine) // 2]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 tokens only, fewer repeats")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--before", default=None,
                        help="git commit whose kernels run side by side (a before/after)")
    args = parser.parse_args()
    load_at_start = os.getloadavg()  # a shared machine: the run's neighbours, recorded
    before = load_before(args.before) if args.before else None
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the native CSR kernels did not build; nothing to put on a roofline")
    reps = args.reps or (3 if args.quick else 9)
    tokens_list = [512] if args.quick else TOKENS
    l2_gb_s = kernels.read_gb_s(L2_PROBE_BYTES)
    rows, cases, bandwidth_by_threads = [], [], {}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        bandwidth = dram_gb_s(reps)
        bandwidth_by_threads[threads] = bandwidth
        print(f"{threads} thread(s): DRAM copy {bandwidth:.1f} GB/s, L2 read {l2_gb_s:.1f} GB/s "
              "per core", flush=True)
        for out_f, in_f in SHAPES:
            for tokens in tokens_list:
                shape_rows, shape_cases = bench_shape(out_f, in_f, tokens, threads, reps,
                                                      bandwidth, l2_gb_s, kernels, before)
                print_rows(shape_rows)
                print_cases(shape_cases)
                rows.extend(shape_rows)
                cases.extend(shape_cases)
    result = summary(rows, cases)
    for key, value in result.items():
        print(f"{key}: {value:.2f}")
    write_json(args.out, {
        "quick": args.quick, "reps": reps, "before_commit": args.before,
        "dram_copy_gb_s": bandwidth_by_threads,
        "l2_read_gb_s_per_core": l2_gb_s,
        **result, "rows": rows, "cases": cases}, load_at_start=load_at_start, kernels=kernels,
        kernel_arch=os.environ.get(ARCH_ENV, NATIVE_ARCH))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
