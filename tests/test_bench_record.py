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


def test_the_load_benchmarks_client_reads_sized_chunked_and_failed_answers():
    """bench/http_client.py: what route_load and api_load measure through."""
    import asyncio

    http_client = bench_module("http_client")
    chunked = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
               b"5\r\nline \r\nb;ext=1\r\nof the log\n\r\n0\r\n\r\n")
    sized = b'HTTP/1.1 404 Not Found\r\nContent-Length: 17\r\n\r\n{"detail": "no"}\n'
    answers = iter([chunked, sized, chunked])
    seen: list[bytes] = []

    async def serve(reader, writer) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            seen.append(head.split(b"\r\n")[0])
            if seen[-1].startswith(b"GET /last"):
                writer.close()  # closed without an answer
                return
            if b"Content-Length: 2" in head:
                await reader.readexactly(2)
            writer.write(next(answers))
            await writer.drain()

    async def main() -> list:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = http_client.Client(f"http://127.0.0.1:{port}", {"X-Token": "t"}, 5.0)
        log = await client.get("/logs")
        missing = await client.post("/jobs", json={})
        again = await client.get("/logs")  # the same kept-alive connection
        try:
            await client.get("/last")
            failed = None
        except http_client.CONNECTION_ERRORS as err:
            failed = err
        server.close()
        return [log, missing, again, failed, len(client._idle)]

    log, missing, again, failed, idle = asyncio.run(main())
    assert (log.status_code, log.content) == (200, b"line of the log\n")
    assert (missing.status_code, missing.json()) == (404, {"detail": "no"})
    assert again.content == log.content
    assert seen == [b"GET /logs HTTP/1.1", b"POST /jobs HTTP/1.1", b"GET /logs HTTP/1.1",
                    b"GET /last HTTP/1.1"]
    assert failed is not None and idle == 0  # the broken connection is not kept

    with http_client.null_server() as base:
        async def null() -> object:
            return await http_client.Client(base, {}, 5.0).get("/anything")
        assert asyncio.run(null()).json() == {"ok": True}
