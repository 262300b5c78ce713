"""Run a ``cerebras.pytorch`` (cstorch) training script on plain PyTorch, one import changed::

    import sparsity.cstorch as cstorch      # was: import cerebras.pytorch as cstorch

Submodules as in cstorch: ``sparse`` (with ``utils``, ``init``), ``optim`` (with
``lr_scheduler``, ``weight_decay_scheduler``, ``scheduler``), ``amp``, ``utils.data``. The parts that drive a Cerebras system run on the
CPU: ``backend(...)`` and its ``device`` context, ``compile`` (the model itself, or
``torch.compile`` when asked), ``trace`` (the function, with its step closures run when it
returns), ``name_scope`` (a no-op context). ``save`` / ``load`` are ``torch.save`` /
``torch.load``, the latter reading numpy values too. ``summarize_scalar`` (cstorch 2.0; removed in 2.x) records scalars for a
writer set with ``set_summary_writer``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import amp, optim, sparse, utils
from ._runtime import RUNTIME, Backend
from .utils.data import current_executor

__all__ = [
    "amp", "optim", "sparse", "utils", "backend", "Backend", "current_backend", "current_torch_device", "use_cs",
    "compile", "trace", "step_closure", "checkpoint_closure", "name_scope", "save", "load", "current_executor",
    "summarize_scalar", "summarize_tensor", "set_summary_writer", "summaries", "summarize_sparsity",
    "ones", "ones_like", "zeros", "zeros_like", "full", "full_like", "tensor", "from_numpy", "to_numpy",
]

# cstorch's device-aware tensor factories: on the CPU, PyTorch's own
ones, ones_like, zeros, zeros_like = torch.ones, torch.ones_like, torch.zeros, torch.zeros_like
full, full_like, tensor = torch.full, torch.full_like, torch.tensor


def from_numpy(array: Any) -> torch.Tensor:
    return torch.from_numpy(array)


def to_numpy(value: torch.Tensor) -> Any:
    return value.detach().cpu().numpy()


def backend(backend_type: str = "CPU", *args: Any, **kwargs: Any) -> Backend:
    """``cstorch.backend("CSX", ...)``: options such as ``cluster_config`` are kept, not used."""
    if not isinstance(backend_type, str):
        raise ValueError(f"backend_type must be a string such as 'CSX' or 'CPU', got {backend_type!r}")
    RUNTIME.backend = Backend(backend_type.upper(), {"args": args, **kwargs})
    return RUNTIME.backend


def current_backend(raise_exception: bool = True, raise_warning: bool = True) -> Backend | None:
    if RUNTIME.backend is None and raise_exception:
        raise RuntimeError("no backend: call cstorch.backend(...) first")
    return RUNTIME.backend


def current_torch_device() -> torch.device:
    return torch.device("cpu")


def use_cs() -> bool:
    """False: nothing here runs on a Cerebras system."""
    return False


def compile(model: torch.nn.Module, backend: Backend | str | None = None,  # noqa: A001 (cstorch's name)
            *, use_torch_compile: bool = False) -> torch.nn.Module:
    """The model itself (hooks and masks unchanged), or ``torch.compile(model)`` if asked."""
    return torch.compile(model) if use_torch_compile else model


def trace(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``@cstorch.trace``: runs ``fn``; step closures it calls run once it has returned."""

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        RUNTIME.tracing_depth += 1
        try:
            result = fn(*args, **kwargs)
        finally:
            RUNTIME.tracing_depth -= 1
        if not RUNTIME.tracing_depth:
            RUNTIME.run_pending()
        return result

    return traced


def step_closure(closure: Callable[..., Any]) -> Callable[..., Any]:
    """Runs ``closure`` after the traced step (at once outside one) with its tensor arguments
    as they were when it was called."""

    @functools.wraps(closure)
    def deferred(*args: Any, **kwargs: Any) -> None:
        RUNTIME.run_or_queue(closure, args, kwargs)

    deferred.is_step_closure = True  # type: ignore[attr-defined]
    return deferred


def checkpoint_closure(closure: Callable[..., Any]) -> Callable[..., Any]:
    """A step closure that runs only on the executor's checkpoint steps (and before the first)."""

    def on_checkpoint_steps(*args: Any, **kwargs: Any) -> None:
        if not RUNTIME.executors:
            raise RuntimeError("Cannot fetch a checkpoint outside of an execution context: call checkpoint "
                               "closures inside the DataExecutor loop")
        executor = RUNTIME.executors[-1]
        if executor.is_pre_initial_step or executor.is_checkpoint_step:
            closure(*args, **kwargs)

    @functools.wraps(closure)
    def deferred(*args: Any, **kwargs: Any) -> None:
        RUNTIME.run_or_queue(on_checkpoint_steps, args, kwargs)

    return deferred


@contextlib.contextmanager
def name_scope(name: str) -> Iterator[None]:
    """Names operations for the Cerebras compiler; nothing to name here."""
    yield


def save(obj: Any, path: Any) -> None:
    torch.save(obj, path)


def load(path: Any, map_location: Any = "cpu", **kwargs: Any) -> Any:
    """``torch.load`` (``weights_only`` unless the caller says otherwise), reading besides
    tensors the numpy values cstorch checkpoints hold, as the reference does: arrays, scalars
    such as an ``np.int64`` step, numpy's RNG state. Only numpy's array and scalar
    constructors and its numeric dtypes are allowed, never arbitrary pickled objects."""
    with torch.serialization.safe_globals(_numpy_value_globals()):
        return torch.load(path, map_location=map_location, **kwargs)


def _numpy_value_globals() -> list[Any]:
    """What a pickle of numpy arrays and scalars of bool, int, uint, float and complex dtypes
    refers to (none without numpy, whose values no checkpoint can then hold)."""
    try:
        import numpy as np
    except ImportError:
        return []
    numeric = [np.dtype(kind + str(size)) for kind, sizes in (("b", [1]), ("i", [1, 2, 4, 8]), ("u", [1, 2, 4, 8]),
                                                              ("f", [2, 4, 8]), ("c", [8, 16])) for size in sizes]
    core = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    return [core._reconstruct, core.scalar, np.ndarray, np.dtype, *(type(dtype) for dtype in numeric)]


# ----------------------------------------------------------------------------- summaries
summaries: dict[str, list[tuple[int, float]]] = {}
_writer: list[Any] = []


def set_summary_writer(writer: Any) -> None:
    """Where ``summarize_scalar`` also writes: any object with ``add_scalar(name, value,
    step)`` (a TensorBoard ``SummaryWriter``, an MLflow adapter); ``None`` stops writing."""
    _writer[:] = [writer] if writer is not None else []


def _current_step() -> int:
    return RUNTIME.executors[-1].user_iteration if RUNTIME.executors else 0


def summarize_scalar(name: str, value: Any) -> None:
    """cstorch 2.0's scalar summary: kept in ``summaries[name]`` as (step, value) and written
    to the summary writer, if one is set."""
    number = float(value.detach().float()) if isinstance(value, torch.Tensor) else float(value)
    step = _current_step()
    summaries.setdefault(name, []).append((step, number))
    for writer in _writer:
        writer.add_scalar(name, number, step)


def summarize_tensor(name: str, value: torch.Tensor) -> None:
    """Summarised as its mean."""
    summarize_scalar(name, value.detach().float().mean())


def summarize_sparsity(algorithm: sparse.SparsityAlgorithm) -> None:
    """``add_summaries: true``: logs ``sparsity/<name>/target`` and ``sparsity/<name>/actual``
    every step through the algorithm's hooks (what ModelZoo's LogSparsity callback logs)."""
    algorithm.register_target_sparsity_hook(lambda _alg, name, value: summarize_scalar(f"sparsity/{name}/target", value))
    algorithm.register_computed_sparsity_hook(lambda _alg, name, value: summarize_scalar(f"sparsity/{name}/actual", value))
