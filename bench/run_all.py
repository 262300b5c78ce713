"""Run every benchmark under bench/ and write bench/results/summary.md.

Each benchmark is a standalone script that writes bench/results/<name>.json; this runs them one
after another (they time CPUs, so never side by side), then tabulates each one's headline
numbers: its top-level ratios, rates and latencies, with the machine they were measured on
(the CPU as every result records it, bench/record.py), and per layer shape of bench/roofline.py
the kernel variant this machine's calibration chose and how far it is from the machine's own
roofline.

    python bench/run_all.py [--quick] [--only csr_linear,dp_scaling]

A complete run (no --only) also copies the table into the guide's benchmarks page
(docs/benchmarks.md, between its bench-summary markers).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from simulator import cpu  # noqa: E402

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
SUMMARY = RESULTS / "summary.md"
BENCHMARKS_PAGE = BENCH.parent / "docs" / "benchmarks.md"
PAGE_START, PAGE_END = "<!-- bench-summary -->", "<!-- /bench-summary -->"
# Not benchmarks: this runner, recovery (a phase of reliability, which runs it), the
# results' machine record and the load benchmarks' HTTP client.
NOT_BENCHMARKS = {"run_all", "recovery", "record", "http_client"}
HEADLINE = re.compile(r"ratio|per_s|per_param|_ms$|speedup|meets_target|targets_met|crossover|efficiency|fraction")


def benchmarks() -> list[str]:
    return sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in NOT_BENCHMARKS)


def headline(result: dict) -> str:
    cells = []
    for key, value in result.items():
        if not HEADLINE.search(key) or isinstance(value, (dict, list)):
            continue
        cells.append(f"{key} = {value:.3g}" if isinstance(value, float) else f"{key} = {value}")
    return "; ".join(cells) or "see JSON"


def machine() -> str:
    return f"{cpu.summary()}; {platform.system()} {platform.release()}, " \
           f"Python {platform.python_version()}"


def variant_table(roofline: dict) -> list[str]:
    """Markdown rows: per shape, tokens, threads and sparsity of a roofline result, the kernel
    variant the calibration chose, its forward+backward time, the roofline bound and the
    fraction of it reached, and the speed-up over masked dense."""
    summary = roofline.get("machine", {}).get("summary", "the machine it names")
    rows = [f"Kernel variants chosen on {summary} (bench/results/roofline.json):", "",
            "| shape | tokens | threads | sparsity | variant | fwd+bwd ms | roofline ms "
            "| of roofline | x masked dense |", "|---|---|---|---|---|---|---|---|---|"]
    for case in roofline.get("cases", []):
        if "variant" not in case:  # a result from before the variants
            continue
        rows.append(f"| {case['shape'][0]}x{case['shape'][1]} | {case['tokens']} | "
                    f"{case['threads']} | {case['sparsity']:.0%} | `{case['variant']}` | "
                    f"{case['variant_ms']:.2f} | {case['bound_ms']:.2f} | "
                    f"{case['variant_fraction_of_bound']:.2f} | {case['variant_ratio']:.2f} |")
    return rows + [""] if len(rows) > 4 else []


def run(name: str, quick: bool) -> tuple[int, float]:
    argv = [sys.executable, str(BENCH / f"{name}.py")] + (["--quick"] if quick else [])
    print(f"== {name}: {' '.join(argv[1:])}", flush=True)
    started = time.perf_counter()
    code = subprocess.call(argv, cwd=BENCH.parent)
    return code, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    parser.add_argument("--only", default=None, help="comma-separated benchmark names")
    args = parser.parse_args()
    names = benchmarks()
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"--only: unknown benchmark(s) {unknown}; choose from {names}")
        names = wanted
    rows, failed = [], 0
    for name in names:
        code, wall_s = run(name, args.quick)
        result_path = RESULTS / f"{name}.json"
        if code == 0 and result_path.exists():
            cells = headline(json.loads(result_path.read_text()))
        else:
            failed += 1
            cells = f"exit code {code}"
        rows.append(f"| `{name}` | {'ok' if code == 0 else 'FAILED'} | {wall_s:.0f} | {cells} |")
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    roofline = RESULTS / "roofline.json"
    variants = variant_table(json.loads(roofline.read_text())) if "roofline" in names else []
    SUMMARY.write_text("\n".join([
        f"Measured {stamp} on {machine()}"
        + (" (`--quick`)" if args.quick else "") + "; regenerate with `make bench`.", "",
        "| benchmark | status | wall s | headline (bench/results/<name>.json) |",
        "|---|---|---|---|", *rows, "", *variants]), encoding="utf-8")
    print(SUMMARY.read_text())
    if not args.only:  # the guide shows a complete run only
        update_benchmarks_page(SUMMARY.read_text(encoding="utf-8"))
    return 1 if failed else 0


def update_benchmarks_page(summary: str) -> None:
    """Put the summary between the benchmarks page's bench-summary markers."""
    page = BENCHMARKS_PAGE.read_text(encoding="utf-8")
    start, end = page.index(PAGE_START) + len(PAGE_START), page.index(PAGE_END)
    BENCHMARKS_PAGE.write_text(page[:start] + "\n" + summary + page[end:], encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
