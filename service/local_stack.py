"""The whole local stack in one process tree: `csx local-study` (what `make run` does).

Starts `mlflow ui`, a Ray head and `csx serve` (joining that head through RAY_ADDRESS) on
127.0.0.1 with free ports and every piece of state under one folder (`.csx/` by default:
SQLite job database, SQLite MLflow store and its artifacts behind the UI's artifact proxy,
checkpoints and job logs), submits a
study YAML over REST with the service's dev token, prints one progress line per variant as it
moves, then the comparison table and the MLflow UI address, and keeps the UI up until Ctrl-C.
The children are service/processes.py's: each stopped with everything it started.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from service.processes import (HOST, LOG_TAIL_LINES, MLFLOW_ARTIFACTS, MLFLOW_STORE, RAY_STARTED,
                               RAY_WORKER_PORTS, StackProcess, check_clear_of_ray_workers,
                               check_port_free, free_port, mlflow_ui_argv, ray_worker_port_args,
                               wait_for_line, wait_until_up)
from workers.hardware import machine_resources, machine_systems, usable_cores

DEV_TOKEN_LINE = re.compile(r"csx dev token \(admin\): (\S+)")
TERMINAL_STATUSES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


@dataclass
class LocalStack:
    """mlflow ui + csx serve sharing one state folder; a context manager that stops both."""

    state_dir: Path
    api_port: int = 0
    ui_port: int = 0
    ray_port: int = 0
    # Simulated systems, one Ray CPU each; None: this machine's (one per core, or one per GPU),
    # with every core, so a many-core machine trains as many variants at once as it can.
    cluster_size: int | None = None
    worker_ports: tuple[int, int] = RAY_WORKER_PORTS
    start_timeout_s: float = 120.0
    processes: list[StackProcess] = field(default_factory=list)
    token: str = ""

    @property
    def api_url(self) -> str:
        return f"http://{HOST}:{self.api_port}"

    @property
    def ui_url(self) -> str:
        return f"http://{HOST}:{self.ui_port}"

    @property
    def systems(self) -> int:
        return self.cluster_size or machine_systems()

    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        check_clear_of_ray_workers(self.worker_ports, {
            "--api-port": self.api_port, "--ui-port": self.ui_port, "the Ray port": self.ray_port})
        for port in (self.api_port, self.ui_port, self.ray_port):
            if port:
                check_port_free(port)
        self.api_port = self.api_port or free_port()
        self.ui_port = self.ui_port or free_port()
        self.ray_port = self.ray_port or free_port()
        self.state_dir = self.state_dir.resolve()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = self._environment()
        # The UI before the service: it creates the MLflow schema, which the service would race.
        ui = self._start("mlflow ui", mlflow_ui_argv(self.state_dir / MLFLOW_STORE,
                                                     self.state_dir / MLFLOW_ARTIFACTS,
                                                     self.ui_port), env)
        # Ray in a process of its own, joined by the service through RAY_ADDRESS (so the
        # service does not start its own; service/supervised.py).
        ray = self._start("ray", [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            "--port", str(self.ray_port), "--num-cpus", str(self.cluster_size or usable_cores()),
            "--resources", json.dumps(machine_resources(self.systems)),
            *ray_worker_port_args(self.worker_ports),
            "--include-dashboard", "false", "--disable-usage-stats"], env)
        wait_until_up(f"{self.ui_url}/health", ui, self.start_timeout_s)
        wait_for_line(RAY_STARTED, ray, self.start_timeout_s)
        api = self._start("csx serve", [sys.executable, "-m", "service.cli", "serve", "--host",
                                        HOST, "--port", str(self.api_port), "--dev-token"], env)
        wait_until_up(f"{self.api_url}/v1/healthz", api, self.start_timeout_s)
        self.token = wait_for_line(DEV_TOKEN_LINE, api, self.start_timeout_s).group(1)

    def _environment(self) -> dict[str, str]:
        state = self.state_dir
        return {
            **os.environ,
            "CSX_DATABASE_URL": f"sqlite:///{state / 'csx.db'}",
            # Through the UI's server: it stores artifacts under mlartifacts/ and records
            # `mlflow-artifacts:/` locations, relative to that folder, so a copy of the state
            # folder opens anywhere (docs/studies.md, "Comparing the variants in MLflow").
            "CSX_MLFLOW_TRACKING_URI": self.ui_url,
            "CSX_MLFLOW_UI_URL": self.ui_url,
            "CSX_RUNS_DIR": str(state / "runs"),
            "CSX_CLUSTER_SIZE": str(self.systems),
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # docs/design.md §6: 7 s and 0.5 GB, not 3 GB
            "RAY_ADDRESS": f"{HOST}:{self.ray_port}",
            "RAY_AUTH_MODE": "disabled",
            "PYTHONUNBUFFERED": "1",
        }

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> StackProcess:
        log = self.state_dir / "logs" / f"{name.replace(' ', '-')}.log"
        # cwd = state folder: MLflow's default ./mlruns artifact root lands there, too.
        process = StackProcess.start(name, argv, log_path=log, env=env, cwd=self.state_dir)
        self.processes.append(process)
        return process

    def check_alive(self) -> None:
        for process in self.processes:
            process.check_alive()

    def stop(self) -> None:
        # Reverse start order: the service stops its jobs before Ray goes away.
        while self.processes:
            self.processes.pop().stop()


class StudyClient:
    """The REST calls of a study, with the stack's bearer token."""

    def __init__(self, api_url: str, token: str) -> None:
        import httpx

        self.http = httpx.Client(base_url=api_url, timeout=60,
                                 headers={"Authorization": f"Bearer {token}"})

    def submit(self, study_yaml: str) -> dict[str, Any]:
        response = self.http.post("/v1/studies", content=study_yaml.encode(),
                                  headers={"Content-Type": "application/yaml"})
        if response.status_code != 201:
            raise ValueError(f"the service refused the study ({response.status_code}): "
                             f"{response.text}")
        return response.json()

    def get(self, path: str) -> Any:
        response = self.http.get(path)
        response.raise_for_status()
        return response.json() if "json" in response.headers.get("content-type", "") \
            else response.text


def progress_line(job: dict[str, Any], elapsed_s: float) -> str:
    variant = job["tags"].get("csx.variant", job["name"])
    progress = job.get("progress") or {}
    line = f"[{elapsed_s:6.0f}s] {variant:<8} {job['status']:<12}"
    if "step" in progress:
        line += (f" step {progress['step']:>5}/{progress['max_steps']:<5} "
                 f"loss {progress['loss']:.3f}  {progress['tokens_per_s']:,.0f} tok/s")
    if job["status"] in ("FAILED", "CANCELLED") and job.get("status_message"):
        line += f"  {job['status_message']}"
    return line


def follow_study(client: StudyClient, study_id: int, stack: LocalStack, *, out: TextIO,
                 poll_s: float = 1.0, quiet_s: float = 10.0) -> dict[str, Any]:
    """Poll the study until every job is terminal, printing a variant's line when its status
    changes or, at most every `quiet_s`, when its step moves on; returns the final study."""
    started = time.monotonic()
    last: dict[int, tuple[str, Any, float]] = {}
    while True:
        stack.check_alive()
        study = client.get(f"/v1/studies/{study_id}")
        now = time.monotonic()
        for job in study["jobs"]:
            step = (job.get("progress") or {}).get("step")
            status, seen_step, printed_at = last.get(job["id"], ("", None, -quiet_s))
            moved = step != seen_step and now - printed_at >= quiet_s
            if job["status"] != status or moved:
                print(progress_line(job, now - started), file=out, flush=True)
                last[job["id"]] = (job["status"], step, now)
        if study["status"] == "DONE":
            return study
        time.sleep(poll_s)


def format_report(rows: list[dict[str, Any]]) -> str:
    def number(value: float | None, spec: str, unit: str = "") -> str:
        return "—" if value is None else format(value, spec) + unit

    header = (f"{'variant':<10} {'status':<10} {'final ppl':>10} {'best ppl':>10} "
              f"{'CS-2 speed-up':>14} {'wall s':>8}")
    lines = [header, "-" * len(header)]
    for row in rows:
        label = row["variant"] if row.get("seed") is None else f"{row['variant']}/s{row['seed']}"
        lines.append(f"{label:<10} {row['status']:<10} "
                     f"{number(row['final_eval_perplexity'], '.3f'):>10} "
                     f"{number(row['best_eval_perplexity'], '.3f'):>10} "
                     f"{number(row['projected_speedup'], '.2f', '×'):>14} "
                     f"{number(row['wall_time_s'], '.0f'):>8}")
    return "\n".join(lines)


def format_comparison(report: dict[str, Any]) -> str:
    """Mean ± sd per variant and the gaps beyond seed noise (when a variant ran several seeds),
    why the speed-up column reads about 1.00× (when it does), and the full-size projection."""
    lines: list[str] = []
    if any(v["runs"] > 1 for v in report.get("variants", [])):
        lines += ["final ppl over seeds (mean ± sd):"]
        for v in report["variants"]:
            sd = v["final_eval_perplexity_sd"]
            mean = v["final_eval_perplexity_mean"]
            lines.append(f"  {v['variant']:<10} " + ("—" if mean is None else f"{mean:.3f}")
                         + ("" if sd is None else f" ± {sd:.3f}") + f"  ({v['runs']} runs)")
        lines += ["gaps (a gap is real when it exceeds the larger sd of the two):"]
        for g in report.get("gaps", []):
            published = f", {g['published']} with the published order" if g["published"] else ""
            noise = "" if g["noise"] is None else f" vs sd {g['noise']:.3f}"
            lines.append(f"  {g['better']} < {g['worse']}: {g['gap']:+.3f}{noise}"
                         f" -> {g['verdict']}{published}")
    speedups = [r["projected_speedup"] for r in report["rows"] if r["projected_speedup"] is not None]
    if speedups and max(abs(s - 1.0) for s in speedups) < 0.01:
        lines += ["CS-2 speed-up is projected for the trained model itself: at this size a step "
                  "is fixed per-layer latency and sync, not FLOPs, so sparsity cannot show."]
    if report.get("full_size"):
        model = report["full_size"][0]["model"]
        systems = sorted({p["num_csx"] for p in report["full_size"]})
        lines += [f"projected for the full-size model ({model}): step ms / speed-up vs dense",
                  f"  {'variant':<10} " + " ".join(f"{f'{n} CS-2':>18}" for n in systems)]
        for variant in dict.fromkeys(p["variant"] for p in report["full_size"]):
            cells = {p["num_csx"]: p for p in report["full_size"] if p["variant"] == variant}
            lines.append(f"  {variant:<10} " + " ".join(
                f"{cells[n]['step_ms']:>9.1f} / {cells[n]['speedup_vs_dense']:.2f}×"
                for n in systems))
    return "\n".join(lines)


def run_local_study(study_path: Path, *, state_dir: Path, api_port: int = 0, ui_port: int = 0,
                    cluster_size: int | None = None, keep_ui: bool = True,
                    out: TextIO = sys.stdout) -> int:
    """Start the stack, run the study to the end, print the report; 0 iff every job succeeded."""
    study_yaml = study_path.read_text(encoding="utf-8")
    with LocalStack(state_dir, api_port=api_port, ui_port=ui_port,
                    cluster_size=cluster_size) as stack:
        print(f"csx API     {stack.api_url}   CSX_TOKEN={stack.token}\n"
              f"MLflow UI   {stack.ui_url}\nstate       {stack.state_dir}", file=out, flush=True)
        client = StudyClient(stack.api_url, stack.token)
        study = client.submit(study_yaml)
        print(f"study {study['id']} '{study['name']}': {len(study['jobs'])} variants submitted",
              file=out, flush=True)
        study = follow_study(client, study["id"], stack, out=out)
        report = client.get(f"/v1/studies/{study['id']}/report")
        print("\n" + format_report(report["rows"]), file=out)
        comparison = format_comparison(report)
        if comparison:
            print("\n" + comparison, file=out)
        if report.get("png_base64"):
            png = stack.state_dir / f"study-{study['id']}-perplexity.png"
            png.write_bytes(base64.b64decode(report["png_base64"]))
            print(f"\nperplexity curves: {png}", file=out)
        failed = [job for job in study["jobs"] if job["status"] != "SUCCEEDED"]
        for job in failed:
            logs = client.get(f"/v1/jobs/{job['id']}/logs?tail={LOG_TAIL_LINES}")
            print(f"\n{job['name']} {job['status']}: {job.get('status_message')}\n{logs}",
                  file=out)
        print(f"MLflow UI: {study['mlflow_url'] or stack.ui_url}", file=out, flush=True)
        if study["mlflow_url"]:
            from service.studies import compare_url

            print(f"Compare the variants (MLflow chart view): "
                  f"{compare_url(study['mlflow_url'], study['id'])}", file=out, flush=True)
        if keep_ui:
            print("Ctrl-C stops the stack.", file=out, flush=True)
            _wait_for_interrupt(stack)
    return 1 if failed else 0


def _wait_for_interrupt(stack: LocalStack) -> None:
    # SIGTERM (e.g. from a process manager) stops the stack like Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while True:
            stack.check_alive()
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
