"""One simulated CS-2 system as a Ray actor: a rank of the job's process group that runs the
training loop.

The runner starts it with the CPUs, GPUs and the ``csx`` resource of its placement-group bundle
(workers/hardware.py); it runs as many torch intra-op threads as it was granted CPUs, and on a
GPU when granted one (Ray sets CUDA_VISIBLE_DEVICES to it, so it is ``cuda:0`` here). Ranks
all-reduce over gloo on CPU and NCCL on GPU.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

# A dead peer closes its sockets and the others fail at once; this bounds the wait when a
# peer hangs instead.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# The folder of a job's model folder where rank 0's tracker keeps what its MLflow server did
# not take while away (tracking.tracker.Tracker), for itself or a resume to send.
MLFLOW_SPOOL = "mlflow_spool"


def average_in_place(tensors: list[torch.Tensor], world_size: int) -> None:
    """All-reduce `tensors` to their mean over the group, one collective per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError("all_reduce takes dense tensors, got "
                            f"{type(tensor).__name__} {getattr(tensor, 'layout', '')}")
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(world_size)
        offset = 0
        for tensor in group:
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


@ray.remote(num_cpus=1, max_restarts=0, max_task_retries=0)
class CsxWorker:
    def __init__(self, rank: int, world_size: int, cpus: int = 1, device: str = "cpu") -> None:
        from workers.hardware import intra_op_threads

        torch.set_num_threads(intra_op_threads(cpus))
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"rank {rank} was granted a GPU but torch sees none "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._allreduce_s = 0.0
        self._allreduce_calls = 0

    def locate(self) -> dict[str, Any]:
        """Where this worker runs: process id, node address, torch threads, device and the GPU
        ids Ray assigned it."""
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "threads": torch.get_num_threads(), "device": self.device,
                "gpu_ids": [str(i) for i in ray.get_gpu_ids()]}

    def free_port(self, host: str) -> int:
        """A free TCP port on `host` of this node, for the group's rendezvous store (rank 0)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            return probe.getsockname()[1]

    def join_group(self, host: str, port: int) -> None:
        """Blocks until all ranks have joined, so the driver calls it on every actor at once."""
        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=COLLECTIVE_TIMEOUT)

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        """Average over the group in place, timing the collective for the scaling report.

        The first call is not timed: it is where the ranks first meet after building their
        models, so it measures their start-up skew, not communication.
        """
        started = time.perf_counter()
        average_in_place(tensors, self.world_size)
        if self._allreduce_calls:
            self._allreduce_s += time.perf_counter() - started
        self._allreduce_calls += 1

    def train(self, plan: Any, *, model_dir: str, mode: str, tracker_args: dict | None,
              relay: Any, train_fn: Callable[..., dict] | None) -> dict[str, Any]:
        """Run the loop on this rank of the job's plan (training.plan.JobPlan); rank 0 also
        logs to MLflow and reports progress."""
        from tracking.tracker import Tracker

        if train_fn is None:
            from training.loop import train as train_fn
        progress = (lambda event: ray.get(relay.put.remote(event))) if relay is not None else None
        tracker = None
        if tracker_args is not None:
            tracker = Tracker(**tracker_args, spool_dir=Path(model_dir) / MLFLOW_SPOOL,
                              notify=progress)
        started = time.perf_counter()
        try:
            summary = train_fn(plan, model_dir=model_dir, mode=mode, rank=self.rank,
                               all_reduce=self.all_reduce if self.world_size > 1 else None,
                               tracker=tracker, progress=progress, device=self.device)
        except BaseException:
            if tracker is not None:
                tracker.flush()  # keep what was logged; the driver decides how the run ends
            raise
        wall_s = time.perf_counter() - started
        if tracker is not None:
            tracker.finish()
        return {**summary, "comm/allreduce_s": self._allreduce_s,
                "comm/allreduce_calls": self._allreduce_calls, "train_wall_s": wall_s}
