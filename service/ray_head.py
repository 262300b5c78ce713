"""The local Ray head of `csx serve`: a supervised child process, never `ray.init` in a thread.

`ray.init` starting a local runtime ties gcs_server and raylet to the *thread* that forked them
(PR_SET_PDEATHSIG): started from a job's execution thread, they die when that job ends and the
server exits a minute later. So when no RAY_ADDRESS is given, the service starts this module
as a child,

    python -m service.ray_head --port P --num-cpus N --log runs/ray/head.log

which runs `ray start --head --block` in a process group of its own, prints READY once Ray is
up, and stops that whole process tree (agents and workers included) when its stdin closes: on
the service's shutdown, and also when the service is killed with SIGKILL, since the kernel
closes the pipe of a dead process. If this watcher itself is killed, `ray start` gets SIGTERM
from the kernel (a parent-death signal) and stops Ray the same way. The service then joins
the head as a driver (`ray.init(address=...)`, which starts no processes of its own).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from service.local_stack import (
    HOST,
    RAY_STARTED,
    StackError,
    StackProcess,
    free_port,
    wait_for_line,
)

READY = "READY"


class RayHead:
    """The service's handle on its ray_head child: `address` to join, `close()` to stop it."""

    def __init__(self, *, num_cpus: int, log_path: Path, start_timeout_s: float = 120.0) -> None:
        self.port = free_port()
        self.address = f"{HOST}:{self.port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "service.ray_head", "--port", str(self.port),
                "--num-cpus", str(num_cpus), "--log", str(log_path),
                "--timeout", str(start_timeout_s)]
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        env.pop("RAY_ADDRESS", None)
        self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env=env, text=True)
        ready = self.popen.stdout.readline().strip() if self.popen.stdout else ""
        if ready != READY:
            self.close()
            tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
            raise StackError(f"the local Ray head did not start ({ready}); {log_path}:\n{tail}")

    def close(self, timeout_s: float = 60.0) -> None:
        """Close the pipe (the child stops Ray) and wait for the child."""
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            self.popen.stdin.close()
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.ray_head")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--num-cpus", type=int, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    # Ctrl-C in the service's terminal reaches this process too; the service decides when Ray
    # goes (after its jobs stopped), by closing the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin_closed = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stdin_closed.set())
    ray = StackProcess.start("ray", [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
        "--port", str(args.port), "--num-cpus", str(args.num_cpus),
        "--include-dashboard", "false", "--disable-usage-stats"],
        log_path=args.log, env=dict(os.environ), cwd=args.log.parent, die_with_parent=True)
    try:
        wait_for_line(RAY_STARTED, ray, args.timeout)
        print(READY, flush=True)
        threading.Thread(target=lambda: (sys.stdin.read(), stdin_closed.set()),
                         daemon=True).start()
        while not stdin_closed.wait(1.0):
            ray.check_alive()
        return 0
    except StackError as err:
        print(f"ray head failed: {err}".replace("\n", " ")[:2000], flush=True)
        return 1
    finally:
        ray.stop()


if __name__ == "__main__":
    sys.exit(main())
