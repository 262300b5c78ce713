"""``cstorch.sparse.configure``: a ``Group`` from a config (float, dict, list, or ModelZoo's
nested ``{"groups": [{"params": {...}, "param_filter": ...}]}``).

Keys: ``algorithm`` (alias ``type``, default ``static``), ``sparsity`` (alias ``schedule``),
``param_filter`` (globs; without it the default filter: matrices whose name has none of
embedding/norm/lm_head/pe_helper), ``add_summaries`` (logs ``sparsity/<name>/target|actual``
through ``cstorch.summarize_scalar``), and the algorithm's own keywords.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any


from ...config import flatten_group
from ...filters import DEFAULT_PARAM_FILTER as default_sparse_param_filter
from .._subclasses import concrete_subclasses
from .base import SparsityAlgorithm
from .group import Group

__all__ = ["configure", "map_sparsity_algorithm", "default_sparse_param_filter", "flatten_sparsity_params"]


def map_sparsity_algorithm(algorithm: str) -> type[SparsityAlgorithm]:
    """The class named ``algorithm`` (any case), user subclasses included."""
    known = {name: cls for name, cls in concrete_subclasses(SparsityAlgorithm).items() if not issubclass(cls, Group)}
    cls = known.get(str(algorithm).lower())
    if cls is None:
        raise ValueError(f"Unsupported sparsity algorithm: {algorithm!r}. Supported: {sorted(known)}")
    return cls


def flatten_sparsity_params(config: Any) -> Any:
    """ModelZoo's nested form → the flat list ``configure`` reads."""
    if not isinstance(config, dict) or "groups" not in config:
        return config

    groups = config["groups"]
    return [flatten_group(g) for g in groups] if isinstance(groups, list) else flatten_group(groups)


def configure(config: Any) -> Group | None:
    """A ``Group`` (``None`` for ``{"sparsity": None}``)."""
    config = flatten_sparsity_params(config)
    if isinstance(config, bool):
        raise ValueError(f"sparsity config cannot be a bool, got {config!r}")
    if isinstance(config, (int, float)):
        return configure({"sparsity": config})
    if isinstance(config, (list, tuple)):
        group = Group()
        for item in config:
            built = configure(item)
            if built is not None:
                group.extend(built)
        return group
    if not isinstance(config, dict):
        raise ValueError(f"sparsity config must be a number, a dict or a list, got {type(config).__name__}")
    options = copy.deepcopy(config)
    if "algorithm" not in options and "type" in options:
        warnings.warn("The 'type' key is deprecated, please use 'algorithm' instead")
        options["algorithm"] = options.pop("type")
    cls = map_sparsity_algorithm(options.pop("algorithm", "static"))
    param_filter = options.pop("param_filter", None)
    add_summaries = options.pop("add_summaries", False)
    if "schedule" in options:
        if "sparsity" in options:
            raise ValueError("Cannot specify both 'sparsity' and 'schedule' in the same config")
        options["sparsity"] = options.pop("schedule")
    if "sparsity" not in options:
        raise ValueError(f"sparsity config {config!r} has no 'sparsity'")
    if options["sparsity"] is None:
        return None
    try:
        algorithm = cls(**options)
    except TypeError as err:
        raise ValueError(f"sparsity config for {cls.__name__}: {err}") from None
    if add_summaries:
        from .. import summarize_sparsity
        summarize_sparsity(algorithm)
    group = Group()
    if param_filter is None:
        group.add(default_sparse_param_filter, algorithm)
    elif isinstance(param_filter, (str, list, tuple)):
        group.add(param_filter, algorithm)
    else:
        raise ValueError(f"param_filter must be a glob or a list of globs, got {type(param_filter).__name__}")
    return group
