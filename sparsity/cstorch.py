"""Run a ``cerebras.pytorch`` training script on plain PyTorch by changing one import::

    import sparsity.cstorch as cstorch      # was: import cerebras.pytorch as cstorch

``cstorch.sparse`` is this library (``cstorch.sparse.RigL``, ``configure_sparsity_wrapper``,
``BaseHyperParameter``, ...), ``cstorch.optim`` its optimizers with ``apply(alg)``. The parts
that drive a Cerebras system run here as no-ops on the CPU: ``backend(...)`` and its
``device`` context (the process's default device), ``compile(model, backend)`` (the model
itself, or ``torch.compile`` when asked), ``trace`` (the function itself). ``save`` / ``load``
are ``torch.save`` / ``torch.load``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import optim

sparse = sys.modules[__package__]  # the sparsity package: cstorch.sparse.<Name>

__all__ = ["sparse", "optim", "backend", "Backend", "compile", "trace", "save", "load"]


@dataclass
class Backend:
    """What ``cstorch.backend(...)`` returns: the type asked for and a device to build models
    under (``with backend.device:``), here always the CPU."""

    backend_type: str = "CPU"
    options: dict[str, Any] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_csx(self) -> bool:
        return False


def backend(backend_type: str = "CPU", *args: Any, **kwargs: Any) -> Backend:
    """``cstorch.backend("CSX", ...)``: options such as ``cluster_config`` are kept, not used."""
    if not isinstance(backend_type, str):
        raise ValueError(f"backend_type must be a string such as 'CSX' or 'CPU', got {backend_type!r}")
    return Backend(backend_type.upper(), {"args": args, **kwargs})


def compile(model: torch.nn.Module, backend: Backend | str | None = None,  # noqa: A001 (cstorch's name)
            *, use_torch_compile: bool = False) -> torch.nn.Module:
    """The model itself (hooks and masks unchanged), or ``torch.compile(model)`` if asked;
    ``backend`` is accepted for the signature and not used."""
    return torch.compile(model) if use_torch_compile else model


def trace(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``@cstorch.trace`` marks the step function to compile for the system; here it runs as is."""
    return fn


def save(obj: Any, path: Any) -> None:
    torch.save(obj, path)


def load(path: Any, map_location: Any = "cpu", **kwargs: Any) -> Any:
    return torch.load(path, map_location=map_location, **kwargs)
