"""Differential harness: runs a cstorch script with the reference (``cerebras.pytorch``) or
with ours (the same file, its one ``import cerebras.pytorch as cstorch`` line changed to
``import sparsity.cstorch as cstorch``) and saves what the script ``record``-ed.

    # in a virtualenv with cerebras-pytorch 2.10 and torch 2.4 (docs/cstorch.md, "Checked
    # against the reference"):
    python tools/cstorch_oracle/harness.py record            # writes tests/fixtures/cstorch_oracle/*.pt
    # anywhere:
    python tools/cstorch_oracle/harness.py compare           # runs ours, compares with the fixtures

Scripts call ``record(key, value)`` (put in their globals by this harness); a value is kept
as plain data: numbers, strings, lists, dicts, and bool tensors (masks) as they are. Each
script runs in its own process and its own temporary folder (the reference's run loop writes
files into the working directory).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPTS = HERE / "scripts"
FIXTURES = REPO / "tests" / "fixtures" / "cstorch_oracle"
REFERENCE_IMPORT = "import cerebras.pytorch as cstorch"
OURS_IMPORT = "import sparsity.cstorch as cstorch"
# scripts that record the reference where we differ on purpose: compared by their own test
DIFFERS_ON_PURPOSE = {"deliberate_differences"}


def script_names() -> list[str]:
    return sorted(p.stem for p in SCRIPTS.glob("*.py"))


def plain(value: Any) -> Any:
    """Tensors become numbers / lists of numbers, except bool tensors (masks), kept whole."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool:
            return value.detach().clone().cpu()
        return value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


def source_for(name: str, flavour: str) -> str:
    source = (SCRIPTS / f"{name}.py").read_text()
    if source.count(REFERENCE_IMPORT) != 1:
        raise ValueError(f"{name}.py must import cstorch exactly once as {REFERENCE_IMPORT!r}")
    return source if flavour == "reference" else source.replace(REFERENCE_IMPORT, OURS_IMPORT)


def run_here(name: str, flavour: str) -> dict[str, list[Any]]:
    """Runs the script in this process (its own folder); returns what it recorded."""
    observations: dict[str, list[Any]] = {}

    def record(key: str, value: Any) -> None:
        observations.setdefault(key, []).append(plain(value))

    previous = os.getcwd()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        try:
            code = compile(source_for(name, flavour), str(SCRIPTS / f"{name}.py"), "exec")
            exec(code, {"__name__": "__main__", "record": record})  # noqa: S102 (our own scripts)
        finally:
            os.chdir(previous)
    return observations


def run_isolated(name: str, flavour: str, python: str = sys.executable) -> dict[str, list[Any]]:
    """Runs the script in a fresh interpreter (``python``); returns what it recorded."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "observations.pt"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([python, str(Path(__file__)), "run", name, flavour, str(out)], check=True, env=env)
        return torch.load(out, weights_only=True)


def differences(expected: Any, actual: Any, where: str = "", rel: float = 1e-4, abs_: float = 1e-6) -> list[str]:
    """Where two recordings differ: masks must be equal, everything else equal, floats within
    ``rel`` (torch 2.4's and this torch's CPU kernels already differ by ~1e-6 in a first
    forward pass; Adam carries that to ~1e-5 over a dozen steps)."""
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        same = (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)
                and expected.shape == actual.shape and torch.equal(expected, actual))
        return [] if same else [f"{where}: masks differ"]
    if isinstance(expected, dict) and isinstance(actual, dict):
        if expected.keys() != actual.keys():
            return [f"{where}: keys {sorted(expected)} != {sorted(actual)}"]
        return [d for k in expected for d in differences(expected[k], actual[k], f"{where}.{k}", rel, abs_)]
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{where}: length {len(expected)} != {len(actual)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, f"{where}[{i}]", rel, abs_)]
    if isinstance(expected, float) or isinstance(actual, float):
        if isinstance(expected, (int, float)) and isinstance(actual, (int, float)) and (
                math.isclose(expected, actual, rel_tol=rel, abs_tol=abs_)
                or (math.isnan(expected) and math.isnan(actual))):
            return []
        return [f"{where}: {expected!r} != {actual!r}"]
    return [] if expected == actual else [f"{where}: {expected!r} != {actual!r}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one script and save its observations")
    run.add_argument("name", choices=script_names())
    run.add_argument("flavour", choices=["reference", "ours"])
    run.add_argument("out", type=Path)
    rec = sub.add_parser("record", help="run every script with the reference; write the fixtures")
    rec.add_argument("names", nargs="*")
    cmp_ = sub.add_parser("compare", help="run every script with ours; compare with the fixtures")
    cmp_.add_argument("names", nargs="*")
    args = parser.parse_args(argv)
    if args.command == "run":
        torch.save(run_here(args.name, args.flavour), args.out)
        return 0
    names = args.names or script_names()
    if args.command == "record":
        import cerebras.pytorch  # noqa: F401 (fail early outside the reference's virtualenv)

        FIXTURES.mkdir(parents=True, exist_ok=True)
        for name in names:
            torch.save(run_isolated(name, "reference"), FIXTURES / f"{name}.pt")
            print(f"recorded {name}")
        return 0
    failed = 0
    for name in names:
        found = differences(torch.load(FIXTURES / f"{name}.pt", weights_only=True), run_isolated(name, "ours"), name)
        on_purpose = name in DIFFERS_ON_PURPOSE
        failed += bool(found) and not on_purpose
        verdict = "MATCH" if not found else f"{len(found)} differences" + (" (on purpose)" if on_purpose else "")
        print(f"{name}: {verdict}")
        for line in found[:20]:
            print("   ", line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
