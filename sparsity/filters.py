"""Which parameters are sparse: the default filter, globs, legacy regexes, and the first-match
routing of groups. One implementation for both APIs: ``sparsity.Group`` and
``sparsity.cstorch.sparse.Group`` route through :class:`FirstMatch`.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["ParamFilter", "DEFAULT_PARAM_FILTER", "make_param_filter", "RegexParamFilter", "FirstMatch"]

ParamFilter = Callable[[str, torch.Tensor], bool]
# cstorch 2.10's default_sparse_param_filter leaves these out, and so does ours
_EXCLUDED_WORDS = ("embedding", "norm", "lm_head", "pe_helper")


def DEFAULT_PARAM_FILTER(name: str, param: torch.Tensor | None) -> bool:  # noqa: N802 (a constant-like callable)
    """Matrices only, and not embeddings, norms, the output head or ALiBi's ``pe_helper``
    (cstorch's ``default_sparse_param_filter``)."""
    lowered = name.lower()
    return param is not None and param.dim() > 1 and not any(word in lowered for word in _EXCLUDED_WORDS)


def make_param_filter(spec: None | str | Iterable[str] | ParamFilter) -> ParamFilter:
    """``None`` → the default filter; a glob or list of globs (fnmatch, full name, ``*``
    crosses dots); a callable ``(name, param) -> bool`` as is.

    Raises:
        ValueError: Anything else, or a list holding a non-string.
    """
    if spec is None:
        return DEFAULT_PARAM_FILTER
    if callable(spec):
        return spec
    globs = [spec] if isinstance(spec, str) else list(spec) if isinstance(spec, (list, tuple)) else None
    if not globs or not all(isinstance(g, str) for g in globs):
        raise ValueError(f"param_filter must be a glob, a list of globs or a callable, got {spec!r}")
    return _GlobFilter(globs)


class _GlobFilter:
    def __init__(self, globs: list[str]) -> None:
        self.globs = globs

    def __call__(self, name: str, param: Any) -> bool:
        return any(fnmatch.fnmatchcase(name, glob) for glob in self.globs)

    def __repr__(self) -> str:
        return f"globs {self.globs!r}"


class RegexParamFilter:
    """Legacy ``param_name_patterns``: a parameter matches when any regex ``re.search``-es its name."""

    def __init__(self, patterns: str | Sequence[str], where: str = "param_name_patterns") -> None:
        patterns = [patterns] if isinstance(patterns, str) else patterns
        if not (
            isinstance(patterns, (list, tuple)) and patterns and all(isinstance(p, str) for p in patterns)
        ):
            raise ValueError(f"{where}: expected a regex, a list of regexes or a dict, got {patterns!r}")
        try:
            self.patterns = [re.compile(p) for p in patterns]
        except re.error as err:
            raise ValueError(f"{where}: bad regex: {err}") from None

    def __call__(self, name: str, param: torch.Tensor) -> bool:
        return any(p.search(name) for p in self.patterns)

    def __repr__(self) -> str:
        return f"RegexParamFilter({[p.pattern for p in self.patterns]!r})"


class FirstMatch:
    """Ordered ``(filter, target)`` routes: a parameter belongs to the first route whose filter
    matches it; a parameter no filter matches belongs to none."""

    def __init__(self) -> None:
        self.routes: list[tuple[ParamFilter, Any]] = []

    def add(self, spec: None | str | Iterable[str] | ParamFilter, target: Any) -> ParamFilter:
        """Appends a route (``spec`` as :func:`make_param_filter` reads it); returns the filter
        that claims what this route gets: its own, minus what earlier routes match."""
        own, earlier = make_param_filter(spec), tuple(f for f, _ in self.routes)
        self.routes.append((own, target))
        return lambda name, param: own(name, param) and not any(f(name, param) for f in earlier)

    def route(self, name: str, param: torch.Tensor) -> Any:
        """The target of the first route matching ``(name, param)``, or None."""
        return next((target for own, target in self.routes if own(name, param)), None)

    def targets(self) -> list[Any]:
        return [target for _, target in self.routes]
