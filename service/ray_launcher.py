"""The launcher the scheduler uses in production: `workers.runner.start_job` on a Ray runtime
sized for the whole cluster (RAY_ADDRESS's, else a local head it starts and stops)."""

from __future__ import annotations

import os
import subprocess
import threading
from typing import Any

from service.scheduler import Handle
from service.settings import Settings


class RayLauncher:
    """start_job on a Ray runtime sized for the whole cluster: RAY_ADDRESS's, else a local head
    this launcher starts as a supervised child on the first launch (service/supervised.py says
    why not ray.init in a thread) and stops on `close()`."""

    def __init__(self, settings: Settings) -> None:
        from service.cluster import LiveCluster

        self.cluster_size = settings.cluster_size
        self.runs_dir = settings.runs_dir
        self.worker_ports = settings.ray_worker_ports
        self._head: Any = None
        self._lock = threading.Lock()
        # Capacity: the live cluster's csx resource (service/cluster.py); before the local head
        # starts, what it will declare.
        self.cluster = LiveCluster(self._planned_cluster)
        settings.read_cluster_from(self.cluster.summary)

    def _planned_cluster(self) -> Any:
        """Not connected yet: RAY_ADDRESS's cluster is joined (as a driver) to be read; the
        local head is what it will declare."""
        from service.cluster import live_summary, machine_summary
        from workers.runner import connect_ray

        address = os.environ.get("RAY_ADDRESS")
        if not address:
            return machine_summary(self.cluster_size)
        with self._lock:
            connect_ray(systems=machine_summary(self.cluster_size).systems, address=address)
        return live_summary()

    def __call__(self, spec: Any, **kwargs: Any) -> Handle:
        import ray

        from service.cluster import machine_summary
        from workers.runner import connect_ray, start_job

        systems = machine_summary(self.cluster_size).systems
        with self._lock:
            address = os.environ.get("RAY_ADDRESS")
            if not address and not ray.is_initialized():
                if self._head is None:
                    from service.supervised import RayHead

                    self._head = RayHead(systems=systems, worker_ports=self.worker_ports,
                                         log_path=self.runs_dir / "ray" / "head.log")
                address = self._head.address
            connect_ray(systems=systems, address=address)
        return start_job(spec, **kwargs)

    def cluster_lost(self, wait_s: float) -> bool:
        """Whether the local Ray head this launcher started died (its watcher exits within a
        second of it): a job's lost workers are then the cluster's fault, not the job's."""
        head = self._head
        if head is None:
            return False
        try:
            head.popen.wait(wait_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def close(self) -> None:
        with self._lock:
            if self._head is not None:
                import ray

                ray.shutdown()
                self._head.close()
                self._head = None
