"""The state a cstorch script's run shares: the backend, step closures queued while a traced
step runs, the executor in progress, and the sparsity algorithms to initialise at run start."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from ._device_rng import Device


@dataclass
class Backend:
    """What ``cstorch.backend(...)`` returns; ``with backend.device:`` builds on the CPU."""

    backend_type: str = "CPU"
    options: dict[str, Any] = field(default_factory=dict)
    device: Device = field(default_factory=Device)

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def is_csx(self) -> bool:
        return False

    @property
    def is_cpu(self) -> bool:
        return True


class Runtime:
    def __init__(self) -> None:
        self.backend: Backend | None = None
        self.tracing_depth = 0
        self.pending_closures: list[tuple[Callable[..., Any], tuple, dict]] = []
        self.executors: list[Any] = []
        self._sparsity: list[weakref.ref] = []

    def register_sparsity(self, algorithm: Any) -> None:
        self._sparsity = [ref for ref in self._sparsity if ref() is not None] + [weakref.ref(algorithm)]

    def sparsity_algorithms(self) -> list[Any]:
        """Every live algorithm in construction order (cstorch initialises them in this order,
        which fixes the global-RNG draws of random masks)."""
        self._sparsity = [ref for ref in self._sparsity if ref() is not None]
        return [ref() for ref in self._sparsity]

    def run_or_queue(self, closure: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        """Inside a traced step, queues ``closure`` with copies of the tensors in its arguments
        (nested in lists, tuples and dicts too), so it sees what they held when it was called,
        not what the rest of the step writes into them (as cstorch copies them)."""
        if self.tracing_depth:
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
            self.pending_closures.append((closure, args, kwargs))
        else:
            closure(*args, **kwargs)

    def run_pending(self) -> None:
        pending, self.pending_closures = self.pending_closures, []
        for closure, args, kwargs in pending:
            closure(*args, **kwargs)


RUNTIME = Runtime()
