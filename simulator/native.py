"""Build, cache and call the C kernels in ``_kernels.c`` (see that file for the layout).

The library is compiled with the system C compiler on first use and cached under
``$CSX_KERNEL_CACHE`` (default ``~/.cache/csx-sparse``), keyed by the sources, the flags and the
CPU's feature flags, so a fresh machine builds it once (about half a second) and a machine with a
different CPU never loads a binary built for another one. When no compiler is available or the
build fails, :func:`load_kernels` logs a warning once and returns None; callers then use torch's
own sparse ops (see ``simulator.csr``).

A :class:`KernelVariant` names one way of running the kernels (issue 46): the vector width they
are built for, whether the backward runs split (spmm over Wᵀ, then sddmm) or fused, whether
outputs are streamed past the cache, and how far ahead the activation tiles are prefetched. Each is exact within float rounding of the others, and which
one a layer shape runs is measured per machine (``simulator.crossover``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from simulator.cpu import cpu_signature

logger = logging.getLogger(__name__)

SOURCE_PATH = Path(__file__).with_name("_kernels.c")
# Every file the build reads (_kernels.c includes the others): all of them key the cached binary.
SOURCES = (SOURCE_PATH, SOURCE_PATH.with_name("_kernels_grad.c"))
# Target flags of the first build tried. $CSX_KERNEL_ARCH overrides them, e.g. "-mavx2 -mfma"
# builds the AVX2 kernels on an AVX-512 machine (bench and tests compare the two builds: the
# targets must hold on any AVX2 machine, not only on the one measured).
NATIVE_ARCH = "-march=native"
ARCH_ENV = "CSX_KERNEL_ARCH"
COMPILE_TIMEOUT_S = 120
# Handing work to another thread costs microseconds, about this many multiply-adds: smaller
# calls run on the calling thread alone.
WORK_PER_EXTRA_THREAD = 1 << 18
MAX_KERNEL_THREADS = 64  # MAX_THREADS in _kernels.c: the C side never runs more
# Kernel outputs (Y, dX, packed activations, values, weight gradients) come from a pool of
# buffers that nothing outside the pool references any more, instead of fresh tensors: fresh
# pages fault on first touch, measured 14 ms for a 32 MiB Y on a 2-core VM (4096 outputs x 2048
# tokens), as long as the forward kernel itself takes at 97% sparsity. The pool keeps at most
# POOLED_PER_SHAPE buffers of a shape (as many as are alive at once, e.g. one per layer of that
# shape during a forward pass, up to that bound) for the POOLED_SHAPES shapes used last.
POOLED_PER_SHAPE = 16
POOLED_SHAPES = 32
# Smaller outputs are plain tensors: malloc serves them from memory already mapped (glibc maps
# fresh pages only from 128 KiB up), and the pool's bookkeeping, microseconds per buffer, would
# be most of a small layer's call.
POOLED_MIN_BYTES = 128 * 1024
SUFFIX_BY_DTYPE = {torch.float32: "f32", torch.float64: "f64"}

VECTOR_WIDTHS = ("native", "256")
BACKWARDS = ("split", "fused", "fused2")
PREFETCH_DISTANCES = (0, 8)

_build_lock = threading.Lock()


@dataclass(frozen=True)
class KernelVariant:
    """One way of running the kernels; the default is the kernels as they were before issue 46.

    vector: "native" (the widest the build target has: 512-bit with AVX-512) or "256" (256-bit
        vectors on an AVX-512 machine; the same as native elsewhere).
    backward: "split" (dX by spmm over Wᵀ, then the weight gradient by sddmm), "fused" (both
        in one pass over Wᵀ, each upstream tile loaded once; see _kernels_grad.c) or "fused2"
        (the same, two token blocks per pass).
    stream: outputs of 256 KiB or more written with streaming (non-temporal) stores.
    prefetch: the fused backward prefetches the upstream tiles of the non-zero this many ahead
        (0: the hardware prefetchers alone; the split backward has none). Measured on the
        AVX-512 Xeon, 8 ahead: 1.05-1.3x faster; in spmm the same was up to 1.15x slower.
    """

    vector: str = "native"
    backward: str = "split"
    stream: bool = True
    prefetch: int = 0

    def __post_init__(self) -> None:
        if self.vector not in VECTOR_WIDTHS:
            raise ValueError(f"vector must be one of {VECTOR_WIDTHS}, got {self.vector!r}")
        if self.backward not in BACKWARDS:
            raise ValueError(f"backward must be one of {BACKWARDS}, got {self.backward!r}")
        if self.prefetch not in PREFETCH_DISTANCES:
            raise ValueError(f"prefetch must be one of {PREFETCH_DISTANCES}, "
                             f"got {self.prefetch!r}")
        if self.prefetch and self.backward == "split":
            raise ValueError("prefetch applies to the fused backward; the split one has none")

    @property
    def name(self) -> str:
        """"vector/backward/stream-or-store/pfN", as results and calibration files name it."""
        return (f"{self.vector}/{self.backward}/{'stream' if self.stream else 'store'}"
                f"/pf{self.prefetch}")

    @classmethod
    def from_name(cls, name: str) -> "KernelVariant":
        """The variant :attr:`name` names, e.g. "native/fused/store/pf8"."""
        parts = name.split("/")
        if (len(parts) != 4 or parts[2] not in ("stream", "store")
                or not parts[3].removeprefix("pf").isdigit()):
            raise ValueError("kernel variant must look like 'native/split/stream/pf0', got "
                             f"{name!r}")
        return cls(parts[0], parts[1], parts[2] == "stream", int(parts[3].removeprefix("pf")))

    @property
    def fused_blocks(self) -> int:
        """Token blocks per pass of the fused backward; 0 for the split one."""
        return {"split": 0, "fused": 1, "fused2": 2}[self.backward]

    def build_flags(self) -> tuple[str, ...]:
        """Compiler flags the variant adds to the build target's."""
        return ("-DCSX_VEC_BYTES=32",) if self.vector == "256" else ()


DEFAULT_VARIANT = KernelVariant()


# Every variant, in the order the calibration times them, the default first: the native width in
# every combination, 256-bit vectors (never faster on the AVX-512 Xeon of issue 46) with the
# split and fused backward and no prefetching, enough to find a machine where they are. The same
# on every machine (on one without AVX-512 "256" builds the native kernels again), so that
# replicas of a job on different machines time as many and can average their timings
# (simulator.crossover).
ALL_VARIANTS = (tuple(KernelVariant("native", backward, stream, prefetch)
                      for backward in BACKWARDS for stream in (True, False)
                      for prefetch in (PREFETCH_DISTANCES if backward != "split" else (0,)))
                + tuple(KernelVariant("256", backward, stream, 0)
                        for backward in ("split", "fused") for stream in (True, False)))


def _cache_dir() -> Path:
    return Path(os.environ.get("CSX_KERNEL_CACHE", Path.home() / ".cache" / "csx-sparse"))


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-o", tmp_name, str(SOURCE_PATH)], check=True,
                       capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        os.replace(tmp_name, target)  # atomic: concurrent processes never see a partial file
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


class BufferPool:
    """Reusable output buffers. :meth:`take` hands out a tensor over the memory of a pooled
    buffer that no tensor refers to any more (a new tensor object, not a view, so autograd may
    adopt it as a gradient without copying), else a new buffer; buffers under `min_bytes` are
    never pooled."""

    def __init__(self, min_bytes: int = 0) -> None:
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        # (shape, dtype) -> [(memory, its reference count while no tensor uses it)]. The pool
        # holds each memory's one Python storage object for good: torch counts a storage
        # object's reference only while it has one, so a storage object made and dropped
        # in between (x.untyped_storage()) would move the count.
        self._buffers: dict[tuple, list[tuple[torch.UntypedStorage, int]]] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if math.prod(shape) * dtype.itemsize < self.min_bytes:
            return torch.empty(shape, dtype=dtype)
        key = (tuple(shape), dtype)
        with self._lock:
            buffers = self._buffers.pop(key, [])
            self._buffers[key] = buffers  # most recently used last
            if len(self._buffers) > POOLED_SHAPES:
                self._buffers.pop(next(iter(self._buffers)))
            for memory, idle_refs in buffers:
                if torch._C._storage_Use_Count(memory._cdata) == idle_refs:
                    return torch.empty(0, dtype=dtype).set_(memory, 0, shape)
            if len(buffers) >= POOLED_PER_SHAPE:
                return torch.empty(shape, dtype=dtype)
            memory = torch.empty(shape, dtype=dtype).untyped_storage()
            buffers.append((memory, torch._C._storage_Use_Count(memory._cdata)))
            return torch.empty(0, dtype=dtype).set_(memory, 0, shape)


class KernelLibrary:
    """Typed wrappers around the compiled kernels. Tensors must be contiguous CPU tensors."""

    def __init__(self, path: Path, flags: tuple[str, ...] = ()) -> None:
        self.path = path
        self.flags = flags  # the compiler flags it was built with (bench results record them)
        self.pool = BufferPool(POOLED_MIN_BYTES)
        self._lib = ctypes.CDLL(str(path))
        self.block_tokens: int = self._lib.csx_block_tokens()
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._lib.csx_mask_counts.argtypes = [ptr, i64, i64, ptr, ptr]
        self._lib.csx_mask_fill.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr]
        self._lib.csx_read_bandwidth_probe.argtypes = [ptr, i64, i64]
        self._lib.csx_read_bandwidth_probe.restype = ctypes.c_float
        for suffix in SUFFIX_BY_DTYPE.values():
            getattr(self._lib, f"csx_pack_{suffix}").argtypes = [ptr, i64, i64, ptr, ptr, ptr,
                                                                  i32]
            getattr(self._lib, f"csx_gather_{suffix}").argtypes = [ptr, ptr, i64, ptr]
            getattr(self._lib, f"csx_spmm_{suffix}").argtypes = [
                ptr, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, i32, i32]
            getattr(self._lib, f"csx_pack_spmm_{suffix}").argtypes = [
                ptr, ptr, ptr, ptr, i32, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, i32, i32]
            getattr(self._lib, f"csx_sddmm_{suffix}").argtypes = [
                ptr, ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i32]
            getattr(self._lib, f"csx_dense_rows_{suffix}").argtypes = [
                ptr, ptr, i64, i64, ptr, ptr, i32]
            getattr(self._lib, f"csx_backward_{suffix}").argtypes = [
                ptr, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i32, i32,
                i32, i32]

    @staticmethod
    def threads_for(work: int) -> int:
        return max(1, min(torch.get_num_threads(), work // WORK_PER_EXTRA_THREAD))

    @staticmethod
    def supports(tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.dtype in SUFFIX_BY_DTYPE

    def _fn(self, name: str, dtype: torch.dtype):
        return getattr(self._lib, f"csx_{name}_{SUFFIX_BY_DTYPE[dtype]}")

    def gather(self, source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """source.view(-1)[index] for a contiguous source and an int64 index."""
        out = self.pool.take((index.numel(),), source.dtype)
        self._fn("gather", source.dtype)(source.data_ptr(), index.data_ptr(), index.numel(),
                                         out.data_ptr())
        return out

    def pack(self, x: torch.Tensor, threads: int | None = None,
             column_sums: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[tokens, features] -> token-blocked [blocks, features, block_tokens], zero padded;
        with column_sums=True also ``x.sum(0)`` (the bias gradient of an upstream gradient x),
        summed while packing: (packed, sums)."""
        tokens, features = x.shape
        blocks = -(-tokens // self.block_tokens)
        packed = self.pool.take((blocks, features, self.block_tokens), x.dtype)
        threads = threads or self.threads_for(x.numel())
        sums = partial = None
        if column_sums:
            sums = self.pool.take((features,), x.dtype)
            partial = self.pool.take((threads, features), x.dtype)
        self._fn("pack", x.dtype)(x.data_ptr(), tokens, features, packed.data_ptr(),
                                  None if sums is None else sums.data_ptr(),
                                  None if partial is None else partial.data_ptr(), threads)
        return packed if sums is None else (packed, sums)

    def spmm(self, indptr: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor,
             bias: torch.Tensor | None, in_features: int, packed_x: torch.Tensor,
             tokens: int, threads: int | None = None, stream: bool = True) -> torch.Tensor:
        """Y = X Aᵀ (+ bias), token-major [tokens, rows], for the CSR matrix A = (indptr, cols,
        vals) and X packed by :meth:`pack` from `tokens` tokens. `threads` overrides the
        count chosen from the work (tests use it to split small problems); `stream`=False
        never streams Y past the cache."""
        rows = indptr.numel() - 1
        out = self.pool.take((tokens, rows), packed_x.dtype)
        self._fn("spmm", packed_x.dtype)(
            indptr.data_ptr(), cols.data_ptr(), vals.data_ptr(),
            None if bias is None else bias.data_ptr(), rows, in_features,
            packed_x.data_ptr(), tokens, out.data_ptr(),
            threads or self.threads_for(cols.numel() * packed_x.shape[0] * self.block_tokens),
            int(stream))
        return out

    def pack_spmm(self, x: torch.Tensor, indptr: torch.Tensor, cols: torch.Tensor,
                  vals: torch.Tensor, bias: torch.Tensor | None, column_sums: bool = False,
                  threads: int | None = None, stream: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`pack` then :meth:`spmm` over the packed x, in one call: (Y, x packed, x's
        column sums or None). Where both split the token blocks alike, each block is packed
        right before it is used (read from L2, not memory); the results are the same bits as
        the two calls'. `threads` overrides both calls' counts (tests)."""
        tokens, features = x.shape
        blocks = -(-tokens // self.block_tokens)
        rows = indptr.numel() - 1
        packed = self.pool.take((blocks, features, self.block_tokens), x.dtype)
        y = self.pool.take((tokens, rows), x.dtype)
        pack_threads = threads or self.threads_for(x.numel())
        spmm_threads = threads or self.threads_for(cols.numel() * blocks * self.block_tokens)
        sums = partial = None
        if column_sums:
            sums = self.pool.take((features,), x.dtype)
            partial = self.pool.take((pack_threads, features), x.dtype)
        self._fn("pack_spmm", x.dtype)(
            x.data_ptr(), packed.data_ptr(), None if sums is None else sums.data_ptr(),
            None if partial is None else partial.data_ptr(), pack_threads, indptr.data_ptr(),
            cols.data_ptr(), vals.data_ptr(), None if bias is None else bias.data_ptr(), rows,
            features, tokens, y.data_ptr(), spmm_threads, int(stream))
        return y, packed, sums

    def csr_from_mask(self, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """CSR arrays of a contiguous 2-D bool CPU mask and of its transpose (the fields of
        ``simulator.csr.CSRStructure``), in two passes over the mask."""
        rows, n_cols = mask.shape
        row_counts = torch.empty(rows, dtype=torch.int32)
        col_counts = torch.empty(n_cols, dtype=torch.int32)
        self._lib.csx_mask_counts(mask.data_ptr(), rows, n_cols, row_counts.data_ptr(),
                                  col_counts.data_ptr())
        indptr, indptr_t = _prefix_sum(row_counts), _prefix_sum(col_counts)
        nnz = int(indptr[-1])
        arrays = {"indptr": indptr, "cols": torch.empty(nnz, dtype=torch.int32),
                  "flat_index": torch.empty(nnz, dtype=torch.int64), "indptr_t": indptr_t,
                  "cols_t": torch.empty(nnz, dtype=torch.int32),
                  "transpose_order": torch.empty(nnz, dtype=torch.int64)}
        if self._lib.csx_mask_fill(mask.data_ptr(), rows, n_cols, indptr.data_ptr(),
                                   *(arrays[k].data_ptr() for k in ("cols", "flat_index")),
                                   indptr_t.data_ptr(),
                                   *(arrays[k].data_ptr() for k in ("cols_t", "transpose_order"))):
            raise MemoryError("csx_mask_fill: out of memory")
        return arrays

    def read_gb_s(self, nbytes: int, reps: int = 200) -> float:
        """Read bandwidth (GB/s, one thread, best of 5) over a buffer of `nbytes`: sized to fit L2
        it measures what streams a vector per FMA from L2 to the cores."""
        buffer = torch.ones(max(64, nbytes // 4))
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            self._lib.csx_read_bandwidth_probe(buffer.data_ptr(), buffer.numel(), reps)
            best = min(best, time.perf_counter() - start)
        return buffer.numel() * 4 * reps / best / 1e9

    def sddmm(self, indptr: torch.Tensor, cols: torch.Tensor, in_features: int,
              packed_grad: torch.Tensor, packed_x: torch.Tensor, dense: bool = False,
              threads: int | None = None, length: int | None = None) -> torch.Tensor:
        """Gᵀ X at the non-zeros of the CSR pattern (indptr, cols), for G and X packed by
        :meth:`pack`: the values in CSR order ([nnz], or zero padded to [length]), or with
        dense=True a dense [rows, in_features] tensor holding them, 0 elsewhere."""
        rows = indptr.numel() - 1
        vals = self.pool.take((length or cols.numel(),), packed_x.dtype)
        vals[cols.numel():].zero_()
        grad = self.pool.take((rows, in_features), packed_x.dtype) if dense else None
        self._fn("sddmm", packed_x.dtype)(
            indptr.data_ptr(), cols.data_ptr(), rows, in_features, packed_grad.data_ptr(),
            packed_x.data_ptr(), packed_x.shape[0], vals.data_ptr(),
            None if grad is None else grad.data_ptr(),
            threads or self.threads_for(cols.numel() * packed_x.shape[0] * self.block_tokens))
        return vals if grad is None else grad

    def dense_rows(self, indptr: torch.Tensor, cols: torch.Tensor, in_features: int,
                   vals: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """The dense [rows, in_features] tensor holding `vals` (CSR order) at the pattern's
        non-zeros, 0 elsewhere."""
        rows = indptr.numel() - 1
        dense = self.pool.take((rows, in_features), vals.dtype)
        self._fn("dense_rows", vals.dtype)(indptr.data_ptr(), cols.data_ptr(), rows, in_features,
                                           vals.data_ptr(), dense.data_ptr(),
                                           threads or self.threads_for(dense.numel()))
        return dense

    def backward(self, indptr_t: torch.Tensor, cols_t: torch.Tensor, vals_t: torch.Tensor,
                 transpose_order: torch.Tensor, grad_y: torch.Tensor, packed_x: torch.Tensor,
                 column_sums: bool = False, length: int | None = None, blocks_per_pass: int = 1,
                 threads: int | None = None, stream: bool = True, prefetch: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The fused backward over the CSR of Wᵀ (indptr_t, cols_t, its values vals_t;
        `transpose_order` maps its non-zeros to W's CSR order), for the upstream gradient
        grad_y [tokens, out_features] and X packed by :meth:`pack`: (dX [tokens, in_features],
        the weight gradient as values in W's CSR order zero padded to `length`, with
        column_sums=True grad_y's column sums (the bias gradient), else None). The same
        products as :meth:`spmm` over Wᵀ and :meth:`sddmm`, each upstream tile loaded once for
        both; grad_y is packed inside the call, `blocks_per_pass` (1 or 2) token blocks at a
        time."""
        if blocks_per_pass not in (1, 2):
            raise ValueError(f"blocks_per_pass must be 1 or 2, got {blocks_per_pass!r}")
        tokens, out_features = grad_y.shape
        in_features, nnz, dtype = indptr_t.numel() - 1, cols_t.numel(), packed_x.dtype
        grad_x = self.pool.take((tokens, in_features), dtype)
        grad_values = self.pool.take((length or nnz,), dtype)
        grad_values[nnz:].zero_()
        scratch = self.pool.take((nnz,), dtype)
        threads = threads or self.threads_for(2 * nnz * packed_x.shape[0] * self.block_tokens)
        threads = max(1, min(threads, MAX_KERNEL_THREADS, in_features))
        # one group of packed upstream blocks per thread: each packs all of it for itself
        buffers = self.pool.take((threads * blocks_per_pass, out_features, self.block_tokens),
                                 dtype)
        sums = self.pool.take((out_features,), dtype) if column_sums else None
        self._fn("backward", dtype)(
            indptr_t.data_ptr(), cols_t.data_ptr(), vals_t.data_ptr(),
            transpose_order.data_ptr(), in_features, out_features, grad_y.data_ptr(),
            None if sums is None else sums.data_ptr(), packed_x.data_ptr(), tokens,
            grad_x.data_ptr(), scratch.data_ptr(), grad_values.data_ptr(), buffers.data_ptr(),
            blocks_per_pass, threads, int(stream), prefetch)
        return grad_x, grad_values, sums


def _prefix_sum(counts: torch.Tensor) -> torch.Tensor:
    indptr = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    torch.cumsum(counts, 0, out=indptr[1:])
    return indptr


def flag_sets(arch: str) -> tuple[tuple[str, ...], ...]:
    """Compiler flags tried in order: with `arch` (for compilers or CPUs that reject it, then
    without it), then without OpenMP (single-threaded kernels)."""
    common = ("-O3", "-ffp-contract=fast")
    return ((*common, *arch.split(), "-fopenmp", "-shared", "-fPIC"),
            (*common, "-fopenmp", "-shared", "-fPIC"),
            (*common, "-shared", "-fPIC"))


def load_kernels(variant: KernelVariant = DEFAULT_VARIANT) -> KernelLibrary | None:
    """The compiled kernels (for $CSX_KERNEL_ARCH, default -march=native, and the build flags
    of `variant`), building them on first use; None (logged once) when impossible."""
    arch = os.environ.get(ARCH_ENV, NATIVE_ARCH)
    return build_kernels(" ".join((arch, *variant.build_flags())).strip())


def kernel_sources() -> bytes:
    """Every file the kernels are built from, as one byte string (what keys their builds and
    the per-machine calibrations that timed them)."""
    return b"".join(path.read_bytes() for path in SOURCES if path.exists())


@functools.cache
def build_kernels(arch: str) -> KernelLibrary | None:
    """The kernels compiled with the target flags `arch` (e.g. "-mavx2 -mfma"); see
    :func:`load_kernels`."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not SOURCE_PATH.exists():
        logger.warning("simulator: no C compiler or kernel source; CSR layers use torch sparse "
                       "ops, which are slower (see bench/csr_linear.py)")
        return None
    source = kernel_sources()
    errors = []
    with _build_lock:
        for flags in flag_sets(arch):
            key = hashlib.sha256(source + " ".join(flags).encode() + compiler.encode()
                                 + cpu_signature().encode()).hexdigest()[:16]
            target = _cache_dir() / f"csx_kernels-{key}.so"
            try:
                if not target.exists():
                    _compile(compiler, flags, target)
                return KernelLibrary(target, flags)
            except (OSError, subprocess.SubprocessError) as error:
                detail = getattr(error, "stderr", "") or str(error)
                errors.append(f"{' '.join(flags)}: {detail.strip()[:500]}")
    logger.warning("simulator: building the CSR kernels failed; CSR layers use torch sparse ops. "
                   "%s", " | ".join(errors))
    return None
