"""The machine every benchmark result is from, written into each bench/results/*.json.

Issue 46: the same kernels ran 2-2.4x slower on an AVX-512 Xeon than on the EPYC their committed
results came from, and no result said which CPU produced it. Every bench script writes its JSON
through :func:`write_json`, which adds ``machine``: the CPU as ``simulator.cpu.describe`` gives
it (model, the SIMD/AMX flags that matter, caches per level, cores and threads), the flags the
CSR kernels were (or would be) built with, the commit of the code, torch and Python versions,
and the load average at the start and end of the run (the machine is shared).

    from record import write_json          # bench/ is on sys.path when a script runs
    load_at_start = os.getloadavg()
    ...
    write_json(path, result, load_at_start=load_at_start, kernels=load_kernels())
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, not installed

from simulator import cpu  # noqa: E402
from simulator.native import ARCH_ENV, NATIVE_ARCH, flag_sets  # noqa: E402


def kernel_build(kernels: Any = None) -> dict:
    """The CSR kernels' build: the library `kernels` was loaded from and its compiler flags,
    or (no kernels given) the flags a build on this machine starts with."""
    if kernels is not None:
        return {"binary": kernels.path.name, "flags": list(kernels.flags)}
    return {"binary": None, "flags": list(flag_sets(os.environ.get(ARCH_ENV, NATIVE_ARCH))[0])}


def commit() -> str | None:
    """The checkout's commit, "+changes" when files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True, timeout=30).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                 cwd=REPO, capture_output=True, text=True, check=True,
                                 timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if changed else "")


def machine(kernels: Any = None, **extra: Any) -> dict:
    """This machine as a result records it; `extra` adds the script's own settings."""
    import torch

    return {"cpu": cpu.describe(), "summary": cpu.summary(), "kernel_build": kernel_build(kernels),
            "commit": commit(), "torch": torch.__version__, "python": platform.python_version(),
            "os": f"{platform.system()} {platform.release()}", **extra}


def write_json(path: Path, result: dict, *, load_at_start: tuple[float, ...] | None = None,
               kernels: Any = None, **extra: Any) -> None:
    """`result` with ``machine`` (see :func:`machine`) and the 1/5/15-minute load average at
    the start (when given) and end of the run, as indented JSON at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    load = {"start": load_at_start, "end": os.getloadavg()}
    payload = {"machine": machine(kernels, **extra), "load_average_1_5_15min": load, **result}
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
