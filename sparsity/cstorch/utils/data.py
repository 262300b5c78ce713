"""``cstorch.utils.data``: ``DataLoader(input_fn, *args, **kwargs)`` and ``DataExecutor``.

``DataExecutor(dataloader, num_steps=None, checkpoint_steps=None, ...)`` yields ``num_steps``
batches (starting the loader again when it runs out), initialises every sparsity algorithm's
masks when the run starts (as cstorch's ``on_run_start``) and tells ``checkpoint_closure``
which steps are checkpoint steps: every ``checkpoint_steps`` and the last one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .._runtime import RUNTIME

__all__ = ["DataLoader", "DataExecutor", "current_executor"]


class DataLoader:
    def __init__(self, input_fn: Callable[..., Iterable[Any]], *args: Any, **kwargs: Any) -> None:
        if not callable(input_fn):
            raise TypeError("DataLoader expects a callable that returns a torch DataLoader or an iterable")
        self.input_fn, self.args, self.kwargs = input_fn, args, kwargs
        self._loader: Iterable[Any] | None = None

    @property
    def loader(self) -> Iterable[Any]:
        if self._loader is None:
            self._loader = self.input_fn(*self.args, **self.kwargs)
        return self._loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


class DataExecutor:
    def __init__(self, dataloader: DataLoader, num_steps: int | None = None, checkpoint_steps: int | None = None,
                 activation_steps: int | None = None, profiler_activities: Any = None) -> None:
        if not isinstance(dataloader, DataLoader):
            raise TypeError("DataExecutor needs a cstorch.utils.data.DataLoader (wrap your input_fn in one)")
        for name, value in (("num_steps", num_steps), ("checkpoint_steps", checkpoint_steps),
                            ("activation_steps", activation_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        self.dataloader = dataloader
        self.num_steps = num_steps if num_steps is not None else len(dataloader)
        self.checkpoint_steps = checkpoint_steps
        self.activation_steps = activation_steps or 1
        self.user_iteration = 0

    @property
    def iteration(self) -> int:
        return self.user_iteration - 1

    @property
    def is_checkpoint_step(self) -> bool:
        if not self.checkpoint_steps:
            return False
        return self.user_iteration % self.checkpoint_steps == 0 or self.user_iteration == self.num_steps

    @property
    def is_final_step(self) -> bool:
        return self.user_iteration >= self.num_steps

    @property
    def is_pre_initial_step(self) -> bool:
        return self.user_iteration == 0

    def __len__(self) -> int:
        return self.num_steps

    def __iter__(self) -> Iterator[Any]:
        for algorithm in RUNTIME.sparsity_algorithms():
            algorithm.initialize()
        RUNTIME.executors.append(self)
        try:
            produced = 0
            while produced < self.num_steps:
                fresh = False
                for batch in self.dataloader:
                    fresh = True
                    self.user_iteration = produced + 1
                    yield batch
                    RUNTIME.run_pending()
                    produced += 1
                    if produced >= self.num_steps:
                        break
                if not fresh:
                    raise RuntimeError("the DataLoader produced no batch")
        finally:
            RUNTIME.executors.remove(self)


def current_executor() -> DataExecutor:
    if not RUNTIME.executors:
        raise RuntimeError("no DataExecutor is running")
    return RUNTIME.executors[-1]
