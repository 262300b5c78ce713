"""The simulated cluster is the Ray cluster: how many CS-2 systems it holds and what hardware
each system of a job gets.

Every Ray node declares its systems as the custom resource ``csx`` (``ray start --resources
'{"csx": K}'``); a job of ``num_csx`` systems asks Ray for one ``csx`` per worker plus the CPUs
and GPUs of ``runconfig.cpus_per_csx`` / ``gpus_per_csx``. Unset, a system gets the cluster's
CPUs shared by the job's systems and one GPU where the cluster has one per system. On a machine with
no cluster, the local runtime declares one system per GPU, else one per core. A node with GPUs
also declares their memory as ``csx_gpu_memory_gib`` (all its GPUs together, in GiB; Ray itself
reports GPUs but not their memory), which admission compares with a job's estimate.

Pure functions over Ray's node records (``ray.nodes()``) and resource totals, importing neither
torch nor ray, so the service, the runner and the tests share them.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

CSX_RESOURCE = "csx"
GPU_MEMORY_RESOURCE = "csx_gpu_memory_gib"
CORES_PER_SYSTEM = 1  # a machine without GPUs declares one system per core
Placement = Literal["PACK", "SPREAD"]


@dataclass(frozen=True)
class Node:
    """One alive Ray node's totals."""

    address: str
    systems: int  # its csx resource
    cpus: float
    gpus: float
    memory_bytes: float
    gpu_memory_bytes: float = 0.0  # each of its GPUs' (0: the node declares none)


@dataclass(frozen=True)
class SystemHardware:
    """What each system (worker) of one job requests from Ray."""

    cpus: int
    gpus: int
    placement: Placement = "PACK"

    def bundle(self) -> dict[str, float]:
        """The worker's placement-group bundle (Ray rejects zero-valued entries)."""
        bundle = {"CPU": float(self.cpus), CSX_RESOURCE: 1.0}
        if self.gpus:
            bundle["GPU"] = float(self.gpus)
        return bundle

    @property
    def device(self) -> str:
        return "cuda" if self.gpus else "cpu"


@dataclass(frozen=True)
class ClusterSummary:
    """The cluster as the service reports it: systems, and the least any system's node offers
    each of them (its CPUs, GPUs and memory divided by the systems it declares)."""

    systems: int
    nodes: int
    cpus_per_system: float
    gpus_per_system: float
    memory_per_system_bytes: float
    gpus: float = 0.0  # on the nodes that hold systems
    gpu_memory_bytes: float = 0.0  # the least one of those GPUs has (0: no node declares it)

    def describe(self) -> str:
        gpu_memory = (f" ({self.gpu_memory_bytes / 2**30:.1f} GiB each)"
                      if self.gpu_memory_bytes else "")
        return (f"{self.systems} CS-2 systems on {self.nodes} Ray node(s); per system "
                f"{self.cpus_per_system:g} CPUs, {self.gpus_per_system:g} GPUs{gpu_memory}, "
                f"{self.memory_per_system_bytes / 2**30:.1f} GiB memory")


def nodes_from_ray(records: list[dict[str, Any]]) -> list[Node]:
    """The alive nodes of ``ray.nodes()``."""
    nodes = []
    for record in records:
        if not record.get("Alive", False):
            continue
        resources = record.get("Resources", {})
        gpus = float(resources.get("GPU", 0))
        gpu_memory = float(resources.get(GPU_MEMORY_RESOURCE, 0)) * 2**30 / gpus if gpus else 0.0
        nodes.append(Node(address=str(record.get("NodeManagerAddress", "")),
                          systems=int(resources.get(CSX_RESOURCE, 0)),
                          cpus=float(resources.get("CPU", 0)), gpus=gpus,
                          memory_bytes=float(resources.get("memory", 0)),
                          gpu_memory_bytes=gpu_memory))
    return nodes


def summarise(nodes: list[Node]) -> ClusterSummary:
    hosts = [node for node in nodes if node.systems > 0]
    if not hosts:
        return ClusterSummary(0, 0, 0.0, 0.0, 0.0)
    declared = [node.gpu_memory_bytes for node in hosts if node.gpus and node.gpu_memory_bytes]
    return ClusterSummary(
        systems=sum(node.systems for node in hosts), nodes=len(hosts),
        cpus_per_system=min(node.cpus / node.systems for node in hosts),
        gpus_per_system=min(node.gpus / node.systems for node in hosts),
        memory_per_system_bytes=min(node.memory_bytes / node.systems for node in hosts),
        gpus=sum(node.gpus for node in hosts), gpu_memory_bytes=min(declared, default=0.0))


def systems_that_fit(nodes: list[Node], cpus: int, gpus: int) -> int:
    """How many workers of `cpus` CPUs and `gpus` GPUs (and one csx each) the nodes hold."""
    total = 0
    for node in nodes:
        by_cpu = math.floor(node.cpus / cpus + 1e-9)
        by_gpu = math.floor(node.gpus / gpus + 1e-9) if gpus else node.systems
        total += min(node.systems, by_cpu, by_gpu)
    return total


def per_system_hardware(nodes: list[Node], num_csx: int, *, cpus_per_csx: int | None = None,
                        gpus_per_csx: int | None = None,
                        placement: Placement = "PACK") -> SystemHardware:
    """Each system's CPUs and GPUs for a job of `num_csx` systems, or ValueError naming the
    key when the cluster could never hold them (rather than a job waiting forever on Ray).

    Defaults, from the cluster's totals (not what is free at this instant, so a job gets the
    same threads, hence the same float results, on every run and every restart): the CPUs of
    the nodes that hold systems split evenly over the job's systems, cut down until the nodes
    can place them; one GPU per system where the nodes can place one per system, else none.
    """
    summary = summarise(nodes)
    if summary.systems < num_csx:
        raise ValueError(f"num_csx={num_csx} needs {num_csx} CS-2 systems; the Ray cluster "
                         f"declares {summary.systems} (resource {CSX_RESOURCE!r}: start nodes "
                         f"with ray start --resources '{{\"{CSX_RESOURCE}\": K}}')")
    if gpus_per_csx is None:
        gpus_per_csx = 1 if systems_that_fit(nodes, cpus_per_csx or 1, 1) >= num_csx else 0
    if cpus_per_csx is None:
        host_cpus = sum(node.cpus for node in nodes if node.systems > 0)
        cpus_per_csx = max(1, math.floor(host_cpus / num_csx + 1e-9))
        while cpus_per_csx > 1 and systems_that_fit(nodes, cpus_per_csx, gpus_per_csx) < num_csx:
            cpus_per_csx -= 1
    if systems_that_fit(nodes, cpus_per_csx, gpus_per_csx) < num_csx:
        raise ValueError(
            f"runconfig.cpus_per_csx={cpus_per_csx} and gpus_per_csx={gpus_per_csx}: the Ray "
            f"cluster cannot place {num_csx} such systems ({summary.describe()})")
    return SystemHardware(cpus=cpus_per_csx, gpus=gpus_per_csx, placement=placement)


def job_footprint(summary: ClusterSummary, num_csx: int, *, cpus_per_csx: int | None = None,
                  gpus_per_csx: int | None = None) -> tuple[float, float]:
    """The CPUs and GPUs a job of `num_csx` systems takes from the cluster while it runs: what
    its placement group holds (`per_system_hardware` on a cluster of `summary`'s nodes, each
    alike). A job the cluster could never place counts as its systems' share, so it reaches
    the runner, which fails it naming the key."""
    per_node = max(1, summary.systems // max(summary.nodes, 1))
    nodes = [Node(address="", systems=per_node, cpus=per_node * summary.cpus_per_system,
                  gpus=per_node * summary.gpus_per_system,
                  memory_bytes=per_node * summary.memory_per_system_bytes)
             for _ in range(max(summary.nodes, 1))]
    try:
        hardware = per_system_hardware(nodes, num_csx, cpus_per_csx=cpus_per_csx,
                                       gpus_per_csx=gpus_per_csx)
    except ValueError:
        return num_csx * summary.cpus_per_system, num_csx * summary.gpus_per_system
    return float(num_csx * hardware.cpus), float(num_csx * hardware.gpus)


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use, without importing torch: the driver's device list,
    narrowed by CUDA_VISIBLE_DEVICES when it is set."""
    driver = Path("/proc/driver/nvidia/gpus")
    present = len(list(driver.iterdir())) if driver.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    return min(present, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))


@functools.cache
def gpu_memory_bytes() -> float:
    """The least memory of one of this machine's NVIDIA GPUs, from nvidia-smi (torch is not
    imported here); 0 without nvidia-smi or GPUs. Read once: it does not change."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0.0
    mib = [float(line) for line in out.split() if line.replace(".", "", 1).isdigit()]
    return min(mib, default=0.0) * 2**20


def machine_resources(systems: int) -> dict[str, float]:
    """The custom resources this machine's Ray node declares: its `systems`, and its GPUs'
    memory where it has GPUs."""
    resources: dict[str, float] = {CSX_RESOURCE: systems}
    if visible_gpus() and gpu_memory_bytes():
        resources[GPU_MEMORY_RESOURCE] = visible_gpus() * gpu_memory_bytes() / 2**30
    return resources


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def machine_systems() -> int:
    """The systems one machine declares when no cluster says: one per GPU, else one per
    CORES_PER_SYSTEM cores."""
    return visible_gpus() or max(1, usable_cores() // CORES_PER_SYSTEM)


def intra_op_threads(granted_cpus: int) -> int:
    """Torch threads for a worker granted `granted_cpus` Ray CPUs: Ray's CPUs are logical, so
    never more threads than the cores this process may run on."""
    return max(1, min(granted_cpus, usable_cores()))
