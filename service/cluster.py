"""The service's cluster: its capacity in simulated CS-2 systems is the Ray cluster's ``csx``
resource, with each system's CPUs, GPUs and memory read from the live nodes.

Before the service's own local Ray head runs (it starts with the first job), the capacity is
what that head will declare: ``CSX_CLUSTER_SIZE``, else the machine's default (one system per
GPU, else one per core: workers/hardware.py), with this machine's cores, GPUs and memory shared
by them. Imports neither torch nor ray (ray only once the service runs on it).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from workers.hardware import (
    CSX_RESOURCE,
    ClusterSummary,
    gpu_memory_bytes,
    machine_systems,
    nodes_from_ray,
    summarise,
    usable_cores,
    visible_gpus,
)

# Nodes join and leave a Ray cluster; the scheduler ticks every 0.2 s. Reading the node table
# this often keeps capacity current without a GCS call per tick.
REFRESH_S = 2.0


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_summary(systems: int | None) -> ClusterSummary:
    """This machine as one node declaring `systems` (None: its default), its cores, GPUs and
    memory shared by them."""
    systems = systems or machine_systems()
    gpus = visible_gpus()
    return ClusterSummary(systems=systems, nodes=1, cpus_per_system=usable_cores() / systems,
                          gpus_per_system=gpus / systems,
                          memory_per_system_bytes=physical_memory_bytes() / systems,
                          gpus=gpus, gpu_memory_bytes=gpu_memory_bytes() if gpus else 0.0)


def connected() -> bool:
    """Whether this process is a driver of a Ray cluster (without importing ray; a ray still
    being imported by another thread is not connected yet)."""
    is_initialized = getattr(sys.modules.get("ray"), "is_initialized", None)
    return bool(is_initialized is not None and is_initialized())


def live_summary() -> ClusterSummary:
    """The connected Ray cluster's systems and per-system hardware."""
    import ray

    return summarise(nodes_from_ray(ray.nodes()))


class LiveCluster:
    """A cached reader of the cluster a launcher runs jobs on: `planned()` until `connected()`
    says the launcher joined Ray, the live cluster's summary after."""

    def __init__(self, planned: Callable[[], ClusterSummary],
                 is_connected: Callable[[], bool] = connected,
                 read: Callable[[], ClusterSummary] = live_summary) -> None:
        self._planned = planned
        self._is_connected = is_connected
        self._read = read
        self._lock = threading.Lock()
        self._cached: ClusterSummary | None = None
        self._read_at = 0.0

    def summary(self) -> ClusterSummary:
        if not self._is_connected():
            return self._planned()
        with self._lock:
            if self._cached is None or time.monotonic() - self._read_at > REFRESH_S:
                self._cached, self._read_at = self._read(), time.monotonic()
            return self._cached


def describe(summary: ClusterSummary, where: str) -> str:
    """One line for `csx serve`: what it found."""
    text = f"cluster ({where}): {summary.describe()}"
    if summary.systems == 0:
        text += (f"; no node declares the {CSX_RESOURCE!r} resource, so no job can start (ray "
                 f"start --resources '{{\"{CSX_RESOURCE}\": K}}' on each node)")
    return text
