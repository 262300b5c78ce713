"""What CPU this is: the one description every benchmark result and the kernel calibration carry.

The fabric's kernels are timed per machine (``simulator.crossover``) and their speed depends on
the CPU far more than on anything else (issue 46: the same kernels took 2-2.4x longer on an
AVX-512 Xeon than on the EPYC they were tuned on, while masked dense cost the same). So a number
is only meaningful with the CPU it came from: :func:`describe` gives the model, the instruction
set extensions the kernels or torch's GEMMs can use, the cache sizes per level, and the cores
and threads. Standard library only; on a system without /proc or /sys the fields it cannot read
are empty.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
CPU_SYSFS = Path("/sys/devices/system/cpu")
# Extensions that change what the kernels or torch's dense GEMMs can do (x86 and Arm names).
FLAGS_THAT_MATTER = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni",
    "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512ifma", "avx512vbmi",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "sve", "sve2", "hypervisor",
)


@functools.cache
def _cpuinfo_lines() -> tuple[str, ...]:
    try:
        return tuple(CPUINFO.read_text(encoding="utf-8").splitlines())
    except OSError:
        return ()


def _first(key: str) -> str:
    for line in _cpuinfo_lines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return ""


def cpu_model() -> str:
    """The CPU's model name (e.g. "Intel(R) Xeon(R) Processor"), else the platform's."""
    return _first("model name") or platform.processor() or platform.machine()


def cpu_flags() -> tuple[str, ...]:
    """Every feature flag the kernel reports for the first CPU, sorted."""
    return tuple(sorted(set((_first("flags") or _first("Features")).split())))


def cpu_signature() -> str:
    """Architecture, model and all feature flags: a binary built with -march=native is valid
    only on a CPU with the same signature."""
    lines = [line for line in _cpuinfo_lines()
             if line.startswith(("flags", "model name", "Features"))]
    if not lines:
        return platform.machine() + platform.processor()
    return platform.machine() + "".join(sorted(set(lines)))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def caches() -> list[dict]:
    """Caches seen by CPU 0, innermost first: level, type, size (KiB, per instance) and how
    many logical CPUs share one."""
    found = []
    for index in sorted(CPU_SYSFS.glob("cpu0/cache/index*")):
        size = _read(index / "size")
        shared = _read(index / "shared_cpu_list")
        found.append({
            "level": int(_read(index / "level") or 0),
            "type": _read(index / "type"),
            "size_kib": int(size[:-1]) if size.endswith("K") else None,
            "shared_by_cpus": _count_cpus(shared) if shared else None,
        })
    return sorted(found, key=lambda c: (c["level"], c["type"]))


def _count_cpus(cpu_list: str) -> int:
    """Logical CPUs in a sysfs list such as "0-3,8"."""
    total = 0
    for part in cpu_list.split(","):
        first, _, last = part.partition("-")
        total += int(last or first) - int(first) + 1
    return total


def topology() -> dict:
    """Logical CPUs, those this process may run on, physical cores and threads per core."""
    cores = {(_read(cpu / "topology/physical_package_id"), _read(cpu / "topology/core_id"))
             for cpu in CPU_SYSFS.glob("cpu[0-9]*") if (cpu / "topology").exists()}
    logical = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    return {"logical_cpus": logical, "usable_cpus": usable, "cores": len(cores) or None,
            "threads_per_core": logical // len(cores) if cores else None}


@functools.cache
def _description() -> tuple:
    flags = set(cpu_flags())
    return (("model", cpu_model()), ("vendor", _first("vendor_id") or platform.machine()),
            ("family_model_stepping",
             "/".join(_first(k) for k in ("cpu family", "model", "stepping")).strip("/")),
            ("flags", [f for f in FLAGS_THAT_MATTER if f in flags]),
            ("caches", caches()), ("topology", topology()))


def describe() -> dict:
    """This machine's CPU as benchmark results record it: model, vendor, family/model/stepping
    numbers (a hypervisor may show a generic model name), the flags of
    :data:`FLAGS_THAT_MATTER` it has, caches (:func:`caches`), topology (:func:`topology`)."""
    return {key: value for key, value in _description()}


def summary(description: dict | None = None) -> str:
    """One line: "model, N cores x T threads, L1d 48 KiB, L2 2048 KiB, L3 ...; flags"."""
    d = description or describe()
    sizes = [f"L{c['level']}{'d' if c['type'] == 'Data' else ''} {c['size_kib']} KiB"
             for c in d["caches"] if c["type"] != "Instruction" and c["size_kib"]]
    top = d["topology"]
    simd = [f for f in d["flags"] if f.startswith(("avx", "amx", "sve", "asimd", "fma"))]
    return (f"{d['model']}, {top['cores'] or '?'} cores x {top['threads_per_core'] or '?'} "
            f"threads, {', '.join(sizes) or 'caches unknown'}; {' '.join(simd) or 'no SIMD flags'}")
