"""Before `make gpu-check`: the venv's torch is a CUDA build where an NVIDIA GPU is, and says
which build it has.

`make install` pins torch's version, and the index it finds it on may serve the CPU build (this
project's machines have a local CPU wheel). On a machine whose NVIDIA driver answers
`nvidia-smi`, a CPU build is replaced by the same version from PyTorch's CUDA wheel index for
that driver (the newest CUDA it supports; ``TORCH_CUDA_INDEX`` names another index URL).

    python tools/cuda_torch.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

INDEX = "https://download.pytorch.org/whl/{tag}"
# PyTorch's CUDA wheel indexes, newest first: (CUDA major, minor, tag).
CUDA_WHEELS = ((13, 0, "cu130"), (12, 9, "cu129"), (12, 8, "cu128"), (12, 6, "cu126"),
               (12, 4, "cu124"), (12, 1, "cu121"), (11, 8, "cu118"))


def driver_cuda() -> tuple[int, int] | None:
    """The CUDA version the NVIDIA driver supports (`nvidia-smi`'s header), or None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", out)
    return (int(match[1]), int(match[2])) if match else None


def cuda_index(driver: tuple[int, int]) -> str | None:
    """The index of the newest CUDA build the driver runs, or None if it runs none listed."""
    tag = next((tag for major, minor, tag in CUDA_WHEELS if (major, minor) <= driver), None)
    return None if tag is None else INDEX.format(tag=tag)


def installed_torch() -> tuple[str, str | None]:
    """(version, CUDA version or None) of the torch this Python imports, read in a fresh process
    (so a reinstall is seen)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], None if out[1] == "None" else out[1]


def describe(version: str, cuda: str | None) -> str:
    return f"torch {version}: {f'a CUDA {cuda} build' if cuda else 'a CPU build'}"


def main() -> int:
    version, cuda = installed_torch()
    driver = driver_cuda()
    if cuda or driver is None:
        print(describe(version, cuda) + ("" if cuda else " (no NVIDIA driver here: none needed)"))
        return 0
    index = os.environ.get("TORCH_CUDA_INDEX") or cuda_index(driver)
    if index is None:
        print(f"{describe(version, cuda)}; the NVIDIA driver supports CUDA {driver[0]}.{driver[1]}, "
              f"older than every PyTorch CUDA build listed here: set TORCH_CUDA_INDEX")
        return 1
    base = version.split("+")[0]
    print(f"{describe(version, cuda)}, but this machine's NVIDIA driver supports CUDA "
          f"{driver[0]}.{driver[1]}: installing torch=={base} from {index}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--force-reinstall", f"torch=={base}",
                    "--index-url", index], check=False)
    version, cuda = installed_torch()
    print(describe(version, cuda))
    return 0 if cuda else 1


if __name__ == "__main__":
    sys.exit(main())
