"""The servers the service and the local stack run as children (mlflow ui, a Ray head, csx
serve): each in its own session and process group, logging to a file, stopped with everything it
started; the checks that one is up; and the ports they take.

Each child runs in its own session, so its process group holds everything it started: Ray's
gcs_server ignores SIGTERM, so on exit each group gets SIGINT (graceful: Ray's atexit hook),
then SIGKILL for whatever is left. Nothing outside those groups is touched.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path

HOST = "127.0.0.1"
RAY_STARTED = re.compile(r"Ray runtime started")
LOG_TAIL_LINES = 30


class StackError(RuntimeError):
    """A process of the stack could not start or died; the message carries its log tail."""


def free_port(host: str = HOST) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def check_port_free(port: int, host: str = HOST) -> None:
    """ValueError if a server listens on the port. Connections in TIME_WAIT (a minute after a
    server with clients died) do not count: servers bind with SO_REUSEADDR, and so does this."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise ValueError(f"port {port} on {host} is taken ({err.strerror}); pass another "
                             "port or 0 for a free one") from None


# Ports Ray's workers bind on the Ray heads and nodes the service starts (CSX_RAY_WORKER_PORTS;
# Ray's own default, 10002-19999, holds ports a user may give the API or MLflow). Below Linux's
# ephemeral range (32768-60999), where free_port() picks the stack's ports.
RAY_WORKER_PORTS = (20000, 29999)


def ray_worker_port_args(worker_ports: tuple[int, int]) -> list[str]:
    return ["--min-worker-port", str(worker_ports[0]), "--max-worker-port", str(worker_ports[1])]


def check_clear_of_ray_workers(worker_ports: tuple[int, int], ports: dict[str, int | None]) -> None:
    """ValueError naming the setting whose port (`ports`: setting -> port) lies in the range
    Ray's workers bind on: a worker taking it first would keep that server from starting."""
    low, high = worker_ports
    for setting, port in ports.items():
        if port is not None and low <= port <= high:
            raise ValueError(f"{setting} uses port {port}, inside the ports Ray's workers bind "
                             f"on ({low}-{high}, CSX_RAY_WORKER_PORTS): move one of them")


@dataclass
class StackProcess:
    """One child of the stack, in its own process group, logging to a file."""

    name: str
    popen: subprocess.Popen
    log_path: Path

    @classmethod
    def start(cls, name: str, argv: list[str], *, log_path: Path, env: dict[str, str],
              cwd: Path, die_with_parent: bool = False) -> StackProcess:
        """`die_with_parent`: the kernel sends the child SIGTERM when this process dies, even
        by SIGKILL (a child in a session of its own is out of reach of its parent's group)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        on_fork = partial(term_on_parent_death, os.getpid()) if die_with_parent else None
        with log_path.open("wb") as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=cwd, stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=on_fork)
        return cls(name, popen, log_path)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if not self.log_path.exists():
            return ""
        with self.log_path.open(encoding="utf-8", errors="replace") as log:
            return "".join(deque(log, maxlen=lines))

    def check_alive(self) -> None:
        code = self.popen.poll()
        if code is not None:
            raise StackError(f"{self.name} exited with code {code}; last lines of "
                             f"{self.log_path}:\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0, reap_s: float = 30.0) -> None:
        """SIGTERM to the process (uvicorn, mlflow and `ray start --block` shut down cleanly on
        it), then SIGKILL to its group and to every descendant seen before: gcs_server ignores
        SIGTERM and Ray puts each worker in a process group of its own. Returns once every one
        of them has exited (SIGKILL is asynchronous: a busy machine takes a while to deliver
        it), or after `reap_s` with a warning naming those still there."""
        family = [(pid, started) for pid in descendants(self.popen.pid)
                  if (started := _start_time(pid)) is not None]
        if self.popen.poll() is None:
            self.popen.terminate()
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        family += [(pid, started) for pid in descendants(self.popen.pid)
                   if (started := _start_time(pid)) is not None]
        _kill_group(self.popen.pid)  # start_new_session: the child leads its own group
        for pid, started in family:
            if _start_time(pid) == started:  # not a new process that reused the id
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.popen.wait()
        deadline = time.monotonic() + reap_s
        while living := [pid for pid, started in family if _is_running(pid, started)]:
            if time.monotonic() > deadline:
                print(f"warning: {self.name}: processes {living} survived SIGKILL for "
                      f"{reap_s:.0f} s", file=sys.stderr)
                return
            time.sleep(0.05)


_PR_SET_PDEATHSIG = 1


def term_on_parent_death(parent: int) -> None:
    """Run in a child (forked, before exec; or a worker process at its start): SIGTERM it
    when the thread that started it exits, or now if `parent` already died before this call
    (then the child was reparented)."""
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (which may hold spaces), or None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None  # field 4: the parent's id


def _start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22: start time in clock ticks


def _is_running(pid: int, started: int) -> bool:
    """The process that had this id and start time exists and is not a zombie (a killed
    process whose parent has not reaped it yet has exited all the same)."""
    fields = _stat_fields(pid)
    return fields is not None and int(fields[19]) == started and fields[0] not in ("Z", "X")


def descendants(root: int) -> list[int]:
    """Every living descendant of `root`, from /proc (empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, pending = [], [root]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_until_up(url: str, process: StackProcess, timeout_s: float) -> None:
    """Poll `url` until it answers 200; fail early, with the log tail, if the process dies."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        process.check_alive()
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise StackError(f"{process.name} did not answer {url} within {timeout_s:.0f} s; last lines "
                     f"of {process.log_path}:\n{process.log_tail()}")


def wait_for_line(pattern: re.Pattern[str], process: StackProcess,
                  timeout_s: float) -> re.Match[str]:
    """The first match of `pattern` in the process's log, once it is written."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = pattern.search(process.log_tail(200))
        if match:
            return match
        process.check_alive()
        time.sleep(0.2)
    raise StackError(f"{process.name} did not print {pattern.pattern!r} within {timeout_s:.0f} s;"
                     f" last lines of {process.log_path}:\n{process.log_tail()}")


MLFLOW_STORE = "mlflow.db"
MLFLOW_ARTIFACTS = "mlartifacts"


def mlflow_ui_argv(store: Path, artifacts: Path, port: int) -> list[str]:
    """`mlflow ui` over a SQLite store, proxying its artifacts: runs record
    `mlflow-artifacts:/<experiment>/<run>/artifacts`, which the server maps to `artifacts`, so
    the store holds no absolute path and survives a move."""
    return [sys.executable, "-m", "mlflow", "ui", "--host", HOST, "--port", str(port),
            "--workers", "1", "--backend-store-uri", f"sqlite:///{store}",
            "--serve-artifacts", "--artifacts-destination", str(artifacts)]
