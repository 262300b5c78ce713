"""The measured dense-vs-CSR rule: a layer runs in CSR only where CSR is predicted faster.

Once per process (per device, dtype, thread count and backend) :func:`calibrate` times a
forward+backward of a probe layer through ``F.linear`` and through ``csr_linear`` at two
densities and two sizes, and fits

    dense: t = o_dense + tokens · out · in · s_mac
    csr:   t = o_csr   + tokens · (nnz · s_nnz + (in + out) · s_feature)

(fixed call overhead, per multiply-accumulate, per non-zero, per activation element packed),
each from the fastest of REPEATS runs. With one thread the runs are timed in the calling
thread's CPU time (everything runs on it): on a machine shared with other processes wall time
made the rule flip between CSR and dense from one process to the next.
A process measures once per machine (:func:`machine_calibration`): the costs go to a file that
every later process on the machine reads, because CSR and dense round differently and a fresh
measurement per process moved the crossover density by ±0.05, so a GraNet run (density passing
0.5 → 0.1) switched layers to CSR at different steps and the same seed gave different losses.
The rule then compares the two predictions for the real shape, density and token count, so
tiny layers and low sparsity stay dense without any hard-coded threshold. The same choice holds
on a RigL/GraNet update step, which needs the dense weight gradient: CSR then runs its forward
and input gradient plus the dense dYᵀX GEMM that the dense layer runs too; with the three CSR
kernels at about the same cost per non-zero (bench/roofline.py) and the three GEMMs likewise,
CSR is faster on an update step exactly where it is on an ordinary one.

Which kernel variant a CSR layer runs (``simulator.native.KernelVariant``: vector width, split or
fused backward, streamed or stored outputs, prefetching) is measured in the same calibration
(issue 46): every variant of ``ALL_VARIANTS`` runs a forward+backward over weights as values on
each of VARIANT_PROBES, a few layer shapes and densities chosen to cross the caches (activation
tiles of one token block from 128 KiB to 1 MiB), and a layer runs the variant that was fastest on
the probe nearest to its shape and density, if it beat the default by VARIANT_MARGIN. The same
kernels were 2-2.4x slower on an AVX-512 Xeon than on the EPYC they were tuned on: no one variant
is fastest everywhere. The choice is part of the calibration file, so every process on a machine
(and, through the job's calibration file, every replica of a job) runs the same variants, and the
same seed gives the same losses.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from simulator.cpu import cpu_model, summary
from simulator.csr import Backend, CSRStructure, csr_linear, resolve_backend, weight_values
from simulator.native import ALL_VARIANTS, DEFAULT_VARIANT, KernelVariant, kernel_sources

PROBE_FEATURES = 512
PROBE_TOKENS = 256
TINY_FEATURES = 8
TINY_TOKENS = 8
PROBE_DENSITIES = (0.5, 0.05)
REPEATS = 5
CACHE_ENV = "CSX_KERNEL_CACHE"  # the folder of the per-machine measurements
# (out_features, in_features, density) of the layers the kernel variants are timed on: one token
# block's activation tile (features x 64 tokens x 4 B) from 128 KiB to 1 MiB on either side, so
# a shape near each probe puts the same pressure on L1 and L2.
VARIANT_PROBES = ((512, 512, 0.1), (1024, 1024, 0.1), (1024, 1024, 0.03), (4096, 1024, 0.1),
                  (1024, 4096, 0.1))
VARIANT_TOKENS = 256
# Fastest of 3 per variant: the 14 variants times 5 probes are most of the calibration's time
# (about 2 s on the 2-core Xeon, once per machine), and an interleaved round slowed by other
# processes slows all of its variants alike.
VARIANT_REPEATS = 3
# How much faster than the default variant another must be timed to replace it: two variants
# within 5% of each other swapped places from one calibration to the next on the shared Xeon.
VARIANT_MARGIN = 0.05
BLOCK_TOKENS = 64  # the kernels' token block (csx_block_tokens): fewer tokens time a padded block
# Part of the per-machine file's name: a file written before the variants were timed is not
# read as a calibration without them (it would pin every layer to the old kernels). The name
# also holds a digest of the kernel sources: changed kernels are timed again.
CALIBRATION_VERSION = 4


@dataclass(frozen=True)
class VariantTiming:
    """Forward+backward ms of every variant timed on one probe layer (fastest of
    VARIANT_REPEATS)."""

    out_features: int
    in_features: int
    density: float
    tokens: int
    ms: tuple[tuple[str, float], ...]  # (variant name, ms), in the order they were timed

    @property
    def fastest(self) -> str:
        """The fastest variant's name (the first timed of equals), or the default variant's
        where none beat it by more than VARIANT_MARGIN: the old kernels stay unless another
        variant is measurably faster, not by the noise of a shared machine."""
        name, ms = min(self.ms, key=lambda item: item[1])
        default = dict(self.ms).get(DEFAULT_VARIANT.name)
        return DEFAULT_VARIANT.name if default is not None and default <= ms * (
            1 + VARIANT_MARGIN) else name

    def distance(self, out_features: int, in_features: int, density: float) -> float:
        """How far a layer is from this probe: log2 ratios of both sides and of the density."""
        return math.dist((math.log2(self.out_features), math.log2(self.in_features),
                          math.log2(self.density)),
                         (math.log2(out_features), math.log2(in_features),
                          math.log2(max(density, 1e-6))))


@dataclass(frozen=True)
class KernelCalibration:
    """Fitted per-call and per-unit costs in seconds (see the module docstring), the kernel
    variants' timings, and the CPU they were measured on (``simulator.cpu.summary``)."""

    dense_call_s: float
    dense_s_per_mac: float
    csr_call_s: float
    csr_s_per_nnz: float
    csr_s_per_feature: float
    backend: str
    threads: int
    variant_timings: tuple[VariantTiming, ...] = ()
    cpu: str = ""

    def __post_init__(self) -> None:
        # read back from JSON: lists and dicts where the dataclasses have tuples and timings
        timings = tuple(t if isinstance(t, VariantTiming)
                        else VariantTiming(**{**t, "ms": tuple(tuple(item) for item in t["ms"])})
                        for t in self.variant_timings)
        object.__setattr__(self, "variant_timings", timings)

    def variant_for(self, out_features: int, in_features: int,
                    density: float) -> KernelVariant:
        """The variant fastest on the probe nearest to this layer (the pre-issue-46 kernels
        where none were timed, e.g. a calibration file written before)."""
        if not self.variant_timings:
            return DEFAULT_VARIANT
        nearest = min(self.variant_timings,
                      key=lambda t: t.distance(out_features, in_features, density))
        return KernelVariant.from_name(nearest.fastest)

    def measurements(self) -> list[float]:
        """Every measured number, in a fixed order (see :meth:`with_measurements`)."""
        costs = [getattr(self, f.name) for f in fields(self) if f.type in ("float", float)]
        return costs + [ms for timing in self.variant_timings for _, ms in timing.ms]

    def with_measurements(self, values: list[float]) -> "KernelCalibration":
        """This calibration with its measurements replaced by `values` (as
        :meth:`measurements` orders them): replicas of a job average theirs, so they choose the
        same kernels and variants."""
        names = [f.name for f in fields(self) if f.type in ("float", float)]
        values = list(values)
        costs, rest = dict(zip(names, values[:len(names)])), values[len(names):]
        timings = []
        for timing in self.variant_timings:
            ms, rest = rest[:len(timing.ms)], rest[len(timing.ms):]
            timings.append(VariantTiming(timing.out_features, timing.in_features,
                                         timing.density, timing.tokens,
                                         tuple((name, value) for (name, _), value
                                               in zip(timing.ms, ms))))
        return KernelCalibration(**{**asdict(self), **costs, "variant_timings": tuple(timings)})

    def predict_dense_s(self, out_features: int, in_features: int, tokens: int) -> float:
        return self.dense_call_s + tokens * out_features * in_features * self.dense_s_per_mac

    def predict_csr_s(self, out_features: int, in_features: int, nnz: int, tokens: int) -> float:
        return self.csr_call_s + tokens * (nnz * self.csr_s_per_nnz
                                           + (in_features + out_features) * self.csr_s_per_feature)

    def crossover_density(self, out_features: int, in_features: int, tokens: int) -> float:
        """Density below which CSR is predicted faster (0 when never, 1 when always)."""
        dense = self.predict_dense_s(out_features, in_features, tokens)
        fixed = self.predict_csr_s(out_features, in_features, 0, tokens)
        per_density = tokens * out_features * in_features * self.csr_s_per_nnz
        return min(1.0, max(0.0, (dense - fixed) / per_density)) if per_density > 0 else 0.0


def _probe(features: int, tokens: int, density: float | None, device: torch.device,
           dtype: torch.dtype, backend: str,
           variant: KernelVariant = DEFAULT_VARIANT) -> Callable[[], None]:
    """A closure running one forward+backward of the square probe layer (dense when density
    is None) on the dense weight."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(features, features, generator=generator, dtype=dtype).to(device)
    weight.requires_grad_(True)
    x = torch.randn(tokens, features, generator=generator, dtype=dtype).to(device)
    x.requires_grad_(True)
    if density is None:
        layer = lambda: F.linear(x, weight)  # noqa: E731
    else:
        mask = (torch.rand(features, features, generator=generator) < density).to(device)
        structure = CSRStructure.from_mask(mask)
        layer = lambda: csr_linear(x, weight, None, structure, backend=backend,  # noqa: E731
                                   variant=variant)

    def run() -> None:
        x.grad = weight.grad = None
        layer().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return run


def _fastest_times(probes: dict[str, Callable[[], None]], device: torch.device,
                   repeats: int = REPEATS) -> dict[str, float]:
    """Fastest of `repeats` runs per probe, the probes interleaved so that load from other
    processes hits all of them alike; the first round only warms up."""
    on_this_thread = device.type == "cpu" and torch.get_num_threads() == 1
    clock = time.thread_time if on_this_thread else time.perf_counter
    best = dict.fromkeys(probes, float("inf"))
    for round_index in range(repeats + 1):
        for name, run in probes.items():
            start = clock()
            run()
            if round_index:
                best[name] = min(best[name], clock() - start)
    return best


def variant_timings(device: torch.device, dtype: torch.dtype, backend: str
                    ) -> tuple[VariantTiming, ...]:
    """Every variant (``simulator.native.ALL_VARIANTS``) timed on every probe of
    VARIANT_PROBES (none on the torch backend, which has no variants)."""
    if backend != "native":
        return ()
    timings = []
    for out_features, in_features, density in VARIANT_PROBES:
        # at most a 512² layer's work at 256 tokens per probe (fewer tokens for the larger
        # layers), and two token blocks at least (fused2 passes over two at a time)
        tokens = min(VARIANT_TOKENS, max(2 * BLOCK_TOKENS, VARIANT_TOKENS * 512 ** 2
                                         // (out_features * in_features)))
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(out_features, in_features, generator=generator, dtype=dtype)
        x = torch.randn(tokens, in_features, generator=generator, dtype=dtype).to(device)
        mask = torch.rand(weight.shape, generator=generator) < density
        structure = CSRStructure.from_mask(mask.to(device))
        values = weight_values(None, structure, weight.to(device)).requires_grad_(True)
        x.requires_grad_(True)
        upstream = torch.randn(tokens, out_features, generator=generator, dtype=dtype).to(device)

        def step(variant: KernelVariant) -> None:
            x.grad = values.grad = None
            csr_linear(x, values, None, structure, backend=backend,
                       variant=variant).backward(upstream)
        times = _fastest_times({v.name: functools.partial(step, v) for v in ALL_VARIANTS},
                               device, VARIANT_REPEATS)
        timings.append(VariantTiming(out_features, in_features, density, tokens,
                                     tuple((name, ms * 1e3) for name, ms in times.items())))
    return tuple(timings)


def fit(times: dict[str, float], backend: str, threads: int) -> KernelCalibration:
    """The costs that explain the probes' times (seconds, keyed as `_calibrate` names them)."""
    f, t = PROBE_FEATURES, PROBE_TOKENS
    tiny_f, tiny_t = TINY_FEATURES, TINY_TOKENS
    high, low = PROBE_DENSITIES
    s_mac = max(0.0, (times["dense_big"] - times["dense_tiny"])
                / (t * f * f - tiny_t * tiny_f * tiny_f))
    dense_call = max(0.0, times["dense_tiny"] - tiny_t * tiny_f * tiny_f * s_mac)
    # A sparse kernel never beats dense GEMM per multiply-add; the floor keeps a timing
    # disturbed by other processes from turning into "CSR is always faster".
    s_nnz = max(s_mac, (times["csr_high"] - times["csr_low"]) / (t * f * f * (high - low)))
    base_big = times["csr_low"] - t * f * f * low * s_nnz     # = o_csr + t · 2f · s_feature
    base_tiny = times["csr_tiny"] - tiny_t * tiny_f * tiny_f * 0.5 * s_nnz
    s_feature = max(0.0, (base_big - base_tiny) / (t * 2 * f - tiny_t * 2 * tiny_f))
    csr_call = max(0.0, base_tiny - tiny_t * 2 * tiny_f * s_feature)
    return KernelCalibration(dense_call, s_mac, csr_call, s_nnz, s_feature, backend, threads)


@functools.cache
def _calibrate(device: torch.device, dtype: torch.dtype, threads: int,
               backend: str) -> KernelCalibration:
    f, t = PROBE_FEATURES, PROBE_TOKENS
    high, low = PROBE_DENSITIES
    measured = KernelCalibration(0.0, 0.0, 0.0, 0.0, 0.0, backend, threads,
                                 variant_timings(device, dtype, backend), summary())
    # the crossover's CSR probes run the variants the layers of their shapes would run
    variant = {density: measured.variant_for(f, f, density) for density in (high, low, 0.5)}
    times = _fastest_times({
        "dense_big": _probe(f, t, None, device, dtype, backend),
        "dense_tiny": _probe(TINY_FEATURES, TINY_TOKENS, None, device, dtype, backend),
        "csr_high": _probe(f, t, high, device, dtype, backend, variant[high]),
        "csr_low": _probe(f, t, low, device, dtype, backend, variant[low]),
        "csr_tiny": _probe(TINY_FEATURES, TINY_TOKENS, 0.5, device, dtype, backend,
                           variant[0.5]),
    }, device)
    costs = fit(times, backend, threads)
    return KernelCalibration(**{**asdict(costs), "variant_timings": measured.variant_timings,
                                "cpu": measured.cpu})


def calibrate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              backend: Backend = "auto") -> KernelCalibration:
    """Measure (once per process and setting; cached) the costs the crossover rule uses."""
    device = torch.device(device)
    resolved, _ = resolve_backend(backend, torch.empty(0, device=device, dtype=dtype))
    return _calibrate(device, dtype, torch.get_num_threads(), resolved)


def machine_calibration(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                        backend: Backend = "auto") -> KernelCalibration:
    """:func:`calibrate`, measured once per machine (CPU model, threads, dtype, kernel backend,
    torch version, kernel sources) and kept in ``$CSX_KERNEL_CACHE`` (default
    ``~/.cache/csx-sparse``), so every process on the machine picks the same kernels; the first
    to measure holds a lock while it does. Read once per process and setting. A GPU, or a
    folder that cannot be written, measures per process."""
    device = torch.device(device)
    if device.type != "cpu":
        return calibrate(device, dtype, backend)
    resolved, _ = resolve_backend(backend, torch.empty(0, device=device, dtype=dtype))
    return _machine_calibration(dtype, resolved, torch.get_num_threads(),
                                os.environ.get(CACHE_ENV, ""))


@functools.cache
def _machine_calibration(dtype: torch.dtype, backend: str, threads: int,
                         folder: str) -> KernelCalibration:
    key = "-".join((cpu_model(), f"{threads}t", str(dtype).removeprefix("torch."), backend,
                    f"torch{torch.__version__}", f"v{CALIBRATION_VERSION}",
                    hashlib.sha256(kernel_sources()).hexdigest()[:12]))
    name = "".join(c if c.isalnum() or c in ".-" else "_" for c in key)
    try:
        cache = Path(folder or Path.home() / ".cache" / "csx-sparse")
        path = cache / f"kernel_calibration-{name}.json"
        cache.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits, then reads the first's
            try:
                return KernelCalibration(**json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError, TypeError):
                measured = calibrate("cpu", dtype, backend)
                partial = path.with_suffix(f".tmp{os.getpid()}")
                partial.write_text(json.dumps(asdict(measured)), encoding="utf-8")
                os.replace(partial, path)
                return measured
    except (OSError, RuntimeError):  # RuntimeError: no home folder to cache in
        return calibrate("cpu", dtype, backend)
