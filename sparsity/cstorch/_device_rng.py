"""cstorch's random numbers under ``with backend.device:`` (model construction, mask
initialisation): every random operation that is given no generator gets a fresh one, seeded
by one ``randint`` draw from the global generator. Reproducing this makes a seeded script
build the reference's weights and initial masks."""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# in-place samplers and factories that take ``generator=``
_WITH_GENERATOR = {
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.bernoulli_, torch.Tensor.random_,
    torch.Tensor.exponential_, torch.Tensor.cauchy_, torch.Tensor.log_normal_, torch.Tensor.geometric_,
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.bernoulli, torch.normal, torch.multinomial,
}
# ``*_like`` factories: drawn as empty_like + the in-place sampler, as cstorch does
_LIKE = {torch.rand_like: ("uniform_", (0.0, 1.0)), torch.randn_like: ("normal_", (0.0, 1.0))}


@functools.lru_cache(maxsize=None)
def _takes_generator(func: Any) -> bool:
    """Builtins in the list above; Python functions (``torch.nn.init.*``) by their signature."""
    if func in _WITH_GENERATOR:
        return True
    try:
        return "generator" in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


def _fresh_generator() -> torch.Generator:
    seed = torch.randint(sys.maxsize, (1,), device="cpu", generator=torch.default_generator).item()
    return torch.Generator().manual_seed(seed)


class SeededGenerators(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _LIKE:
            sampler, bounds = _LIKE[func]
            out = torch.empty_like(*args, **kwargs)
            return getattr(out, sampler)(*bounds, generator=_fresh_generator())
        if kwargs.get("generator") is None and _takes_generator(func):
            kwargs["generator"] = _fresh_generator()
        return func(*args, **kwargs)


class Device:
    """``backend.device``: prints as ``cpu``; as a context manager, builds on the CPU with
    cstorch's generator seeding."""

    type = "cpu"

    def __init__(self) -> None:
        self._modes: list[SeededGenerators] = []

    def __enter__(self) -> Device:
        mode = SeededGenerators()
        mode.__enter__()
        self._modes.append(mode)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._modes.pop().__exit__(*exc)

    def __str__(self) -> str:
        return "cpu"

    __repr__ = __str__
