"""Servers `csx serve` starts for itself: its local Ray head and its MLflow UI, as supervised
children, never `ray.init` in a thread.

`ray.init` starting a local runtime ties gcs_server and raylet to the *thread* that forked them
(PR_SET_PDEATHSIG): started from a job's execution thread, they die when that job ends and the
server exits a minute later. So the service starts each server through this module,

    python -m service.supervised --log runs/ray/head.log --ready-line 'Ray runtime started' \
        -- python -m ray.scripts.scripts start --head --block ...

which runs the command in a process group of its own, prints READY once it is up (its log
printed the line, or its URL answered 200), and stops that whole process tree (Ray's agents and
workers, uvicorn under `mlflow ui`) when its stdin closes: on the service's shutdown, and also
when the service is killed with SIGKILL, since the kernel closes the pipe of a dead process. If
this watcher itself is killed, the command gets SIGTERM from the kernel (a parent-death signal)
and stops the same way.

A server that dies is restarted (`--restart`): what is left of its process tree is killed first,
so a dead `mlflow ui`'s worker no longer holds the port, its log is kept beside the new one as
`<log>.1`, and it comes back on the same port. More than MAX_RESTARTS deaths within
RESTART_WINDOW_S end the watcher instead: a server that cannot stay up is reported, not looped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from service.processes import (
    HOST,
    MLFLOW_ARTIFACTS,
    RAY_STARTED,
    StackError,
    StackProcess,
    check_port_free,
    free_port,
    mlflow_ui_argv,
    ray_worker_port_args,
    wait_for_line,
    wait_until_up,
)
from service.mlflow_auth import CREDENTIALS_ENV, MlflowAccess, server_env
from workers.hardware import machine_resources

READY = "READY"
MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0


class SupervisedChild:
    """A server run through this module's watcher: `close()` (or the caller's death) stops it."""

    def __init__(self, name: str, argv: list[str], *, log_path: Path, env: dict[str, str],
                 ready_line: str | None = None, ready_url: str | None = None,
                 start_timeout_s: float = 120.0, restart: bool = False) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        watcher = [sys.executable, "-m", "service.supervised", "--log", str(log_path),
                   "--timeout", str(start_timeout_s)] + (["--restart"] if restart else [])
        watcher += ["--ready-line", ready_line] if ready_line else ["--ready-url", str(ready_url)]
        self.popen = subprocess.Popen([*watcher, "--", *argv], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env, text=True)
        ready = self.popen.stdout.readline().strip() if self.popen.stdout else ""
        if ready != READY:
            self.close()
            tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
            raise StackError(f"{name} did not start ({ready}); {log_path}:\n{tail}")

    def close(self, timeout_s: float = 60.0) -> None:
        """Close the pipe (the watcher stops the server) and wait for the watcher."""
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            self.popen.stdin.close()
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


class RayHead(SupervisedChild):
    """A local Ray head on a free port declaring `systems` simulated CS-2 systems (the `csx`
    resource) over all of this machine's CPUs and GPUs, its workers binding `worker_ports`;
    the service joins it at `address` as a driver (`ray.init(address=...)`, which starts no
    processes of its own)."""

    def __init__(self, *, systems: int, log_path: Path, worker_ports: tuple[int, int],
                 start_timeout_s: float = 120.0) -> None:
        port = free_port()
        self.address = f"{HOST}:{port}"
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        # Jobs' workers get MLflow's credentials through their runtime environment; no other
        # Ray process needs them.
        for name in ("RAY_ADDRESS", *CREDENTIALS_ENV):
            env.pop(name, None)
        super().__init__("the local Ray head", [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            "--port", str(port), "--resources", json.dumps(machine_resources(systems)),
            *ray_worker_port_args(worker_ports), "--include-dashboard", "false",
            "--disable-usage-stats"], log_path=log_path, env=env,
            ready_line=RAY_STARTED.pattern, start_timeout_s=start_timeout_s)


class MlflowUI(SupervisedChild):
    """`mlflow ui` over a SQLite store with its artifact proxy, at `url` (127.0.0.1 and a port):
    runs logged through it record `mlflow-artifacts:/` locations, relative to the
    `mlartifacts/` folder beside the store, so the store survives a copy or a move. With
    `access`, it runs MLflow's basic-auth app with that admin account, its users kept beside
    the store (service/mlflow_auth.py)."""

    def __init__(self, *, store: Path, url: str, log_path: Path,
                 access: MlflowAccess | None = None, start_timeout_s: float = 120.0) -> None:
        address = urlsplit(url)
        if address.scheme != "http" or address.hostname not in (HOST, "localhost") \
                or not address.port:
            raise ValueError(f"CSX_MLFLOW_UI_URL must be http://{HOST}:<port> for the MLflow UI "
                             f"csx serve starts, not {url!r}; or give CSX_MLFLOW_TRACKING_URI "
                             "an MLflow server's http:// address")
        check_port_free(address.port)
        self.url = f"http://{HOST}:{address.port}"
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # docs/design.md §6
        argv = mlflow_ui_argv(store, store.parent / MLFLOW_ARTIFACTS, address.port)
        if access is not None:
            env |= server_env(access, store.parent)
            argv += ["--app-name", "basic-auth"]
        # Restarted when it dies: every job logs through it, so a dead UI would stall them all.
        super().__init__("the MLflow UI", argv,
                         log_path=log_path, env=env, ready_url=f"{self.url}/health",
                         start_timeout_s=start_timeout_s, restart=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.supervised")
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--restart", action="store_true", help="restart the server if it dies")
    ready = parser.add_mutually_exclusive_group(required=True)
    ready.add_argument("--ready-line", help="regular expression the log prints once up")
    ready.add_argument("--ready-url", help="URL that answers 200 once up")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the server's argv")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the server's command after --")
    # Ctrl-C in the service's terminal reaches this process too; the service decides when the
    # server goes (after its jobs stopped), by closing the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin_closed = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stdin_closed.set())

    def start() -> StackProcess:
        server = StackProcess.start(Path(command[0]).name, command, log_path=args.log,
                                    env=dict(os.environ), cwd=args.log.parent,
                                    die_with_parent=True)
        try:
            if args.ready_line:
                wait_for_line(re.compile(args.ready_line), server, args.timeout)
            else:
                wait_until_up(args.ready_url, server, args.timeout)
        except BaseException:
            server.stop()
            raise
        return server

    server = None
    deaths: list[float] = []
    try:
        server = start()
        print(READY, flush=True)
        threading.Thread(target=lambda: (sys.stdin.read(), stdin_closed.set()),
                         daemon=True).start()
        while not stdin_closed.wait(1.0):
            try:
                server.check_alive()
                continue
            except StackError:
                now = time.monotonic()
                deaths = [t for t in deaths if now - t < RESTART_WINDOW_S] + [now]
                if not args.restart or len(deaths) > MAX_RESTARTS:
                    raise
            server.stop()  # what it left running, its port included
            args.log.replace(args.log.with_name(args.log.name + ".1"))
            server = start()
        return 0
    except StackError as err:
        print(f"{Path(command[0]).name} failed: {err}".replace("\n", " ")[:2000], flush=True)
        return 1
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
