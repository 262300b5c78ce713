"""Peak memory of `csx run --validate_only` on the largest ModelZoo corpus files.

Each file is validated in a fresh process (`python -m csx.cli run --params F
--validate_only`), and its peak resident memory (ru_maxrss of the child) is read; the target is
under 1 GB for the largest file. Also shows torch's import alone, the floor of every run.
Writes bench/results/corpus_validate_memory.json.

    python bench/corpus_validate_memory.py [--files N]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, not installed

from csx_config import JobSpec, parse_yaml  # noqa: E402
from record import write_json  # noqa: E402  (bench/ is on sys.path as a script)

CORPUS = ROOT / "tests" / "fixtures" / "modelzoo_corpus"


def size_of(path: Path) -> int | None:
    """hidden_size^2 x layers as a size key; None for a file the schema refuses."""
    try:
        spec = JobSpec.model_validate(parse_yaml(path.read_text()))
    except ValueError:
        return None
    model = spec.model.resolved()
    return model["hidden_size"] ** 2 * model["num_hidden_layers"]


def peak_mb(command: list[str]) -> tuple[float, str]:
    """Run ``command`` as the only child of a fresh process and read that child's peak RSS."""
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); print(r.stdout[:20000])")
    out = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    kb, _, rest = out.partition("\n")
    return int(kb) / 1024, rest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=3, help="how many of the largest files")
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    sized = [(s, p) for p in sorted(CORPUS.glob("*/*/*.yaml")) if (s := size_of(p)) is not None]
    largest = [p for _, p in sorted(sized, reverse=True)[: args.files]]
    floor, _ = peak_mb([sys.executable, "-c", "import torch"])
    rows = []
    for path in largest:
        mb, out = peak_mb([sys.executable, "-m", "csx.cli", "run", "--params", str(path), "--validate_only"])
        params = re.search(r"([\d,]+) parameters", out)
        rows.append({"file": str(path.relative_to(CORPUS)), "parameters": params and params[1],
                     "peak_mb": round(mb, 1)})
        print(f"{rows[-1]['file']:70s} {rows[-1]['parameters']:>18s} params  peak {mb:7.1f} MB")
    print(f"import torch alone: peak {floor:.1f} MB; target: every file under 1024 MB")
    result = {"import_torch_mb": round(floor, 1), "files": rows, "target_mb": 1024,
              "within_target": all(r["peak_mb"] < 1024 for r in rows)}
    out = ROOT / "bench" / "results" / "corpus_validate_memory.json"
    write_json(out, result, load_at_start=load_at_start)
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
