"""The state a cstorch script's run shares: the backend, step closures queued while a traced
step runs, the executor in progress, and the sparsity algorithms to initialise at run start."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

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
        if self.tracing_depth:
            self.pending_closures.append((closure, args, kwargs))
        else:
            closure(*args, **kwargs)

    def run_pending(self) -> None:
        pending, self.pending_closures = self.pending_closures, []
        for closure, args, kwargs in pending:
            closure(*args, **kwargs)


RUNTIME = Runtime()
