"""Every benchmark result names its machine (bench/record.py), and make bench tabulates the
kernel variant each shape chose (bench/run_all.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from simulator import cpu
from simulator.native import load_kernels

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_module(name: str):
    """A bench/ script as a module (bench/ on sys.path, as when it runs)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_a_result_records_the_cpu_the_kernel_build_and_the_load(tmp_path):
    record = bench_module("record")
    kernels = load_kernels()
    path = tmp_path / "results" / "x.json"
    record.write_json(path, {"ratio": 2.5}, load_at_start=(1.0, 2.0, 3.0), kernels=kernels,
                      threads=1)
    result = json.loads(path.read_text())
    machine = result["machine"]
    assert machine["cpu"] == json.loads(json.dumps(cpu.describe()))
    assert machine["summary"] == cpu.summary() and machine["threads"] == 1
    assert machine["commit"] is None or len(machine["commit"].removesuffix("+changes")) == 40
    if kernels is not None:
        assert machine["kernel_build"] == {"binary": kernels.path.name,
                                           "flags": list(kernels.flags)}
        assert "-O3" in machine["kernel_build"]["flags"]
    assert result["load_average_1_5_15min"]["start"] == [1.0, 2.0, 3.0]
    assert len(result["load_average_1_5_15min"]["end"]) == 3 and result["ratio"] == 2.5
    assert record.kernel_build()["binary"] is None  # no kernels: the flags a build would use


def test_make_bench_tabulates_each_shapes_variant_and_its_distance_from_the_roofline():
    run_all = bench_module("run_all")
    assert "record" not in run_all.benchmarks()  # a helper, not a benchmark
    case = {"shape": [1024, 1024], "tokens": 512, "threads": 2, "sparsity": 0.9,
            "variant": "native/fused2/store/pf8", "variant_ms": 4.0, "bound_ms": 2.0,
            "variant_fraction_of_bound": 0.5, "variant_ratio": 5.25}
    old = {key: case[key] for key in ("shape", "tokens", "threads", "sparsity")}
    table = run_all.variant_table({"machine": {"summary": "Some CPU, 2 cores"},
                                   "cases": [case, old]})
    assert table[0].startswith("Kernel variants chosen on Some CPU, 2 cores")
    assert table[4] == ("| 1024x1024 | 512 | 2 | 90% | `native/fused2/store/pf8` | 4.00 | 2.00 | "
                        "0.50 | 5.25 |")
    assert len(table) == 6  # the case from before the variants has no row
    assert run_all.variant_table({"cases": [old]}) == []
