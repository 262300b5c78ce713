"""``configure()``: the one place that reads raw sparsity configs (ModelZoo 2.x and 1.8/2.1 layouts).

Accepted shapes::

    0.8                                   # uniform 80% with the default algorithm, "static"
    {"algorithm": "rigl", "sparsity": 0.8, "update": {"freq": 100, "stop": 3000}, ...}
    [{"param_filter": "*fc1*", ...}, {...}]   # groups; a parameter goes to the FIRST that matches
    {"groups": [{...}, {...}], **defaults}   # the same, top-level keys are defaults for each group
    {"groups": [{"params": {...}, "param_filter": ...}]}   # ModelZoo's nested group, flattened

Keys (2.x): ``algorithm`` (alias ``type``), ``sparsity`` (alias ``schedule``), ``param_filter``
(fnmatch globs, full-name match), ``init_method``, ``distribution``, ``update``,
``drop_fraction``, ``balance_in_groups``, ``balance_out_groups``, ``seed``, and any other
keyword parameter of the algorithm's constructor (e.g. GraNet's ``init_sparsity``, ``pruning``).
Any other key is a ValueError that names it and lists the allowed ones.

Legacy keys (1.8 / 2.1):

- ``add_summaries`` (ModelZoo 2.0's switch for sparsity summaries): accepted, true or false;
  every csx-sparse run logs ``sparsity/<name>/target`` and ``/actual`` anyway.
- ``type: sideband`` is the 1.x name of ``static``.
- ``param_name_patterns``: a regex, a list of regexes (``re.search`` on the parameter name), or
  a dict ``regex → options`` that makes one group per pattern, in order, each pattern's options
  overriding the top-level keys (a bare number as options means ``{"sparsity": number}``).
- ``schedule`` means one of two things, told apart by content:
  an int ≥ 1 or a dict of ``freq``/``start``/``stop``/``steps`` is the update cadence (``update``);
  a float, an int 0, a dict with ``type``, a list (cycling) or a callable is the sparsity.
- ``sparsity_schedule: [[step, value], ...]``: piecewise-constant sparsity (the value of the last
  boundary ≤ t; before the first boundary, the first value). Unless a cadence is given, the masks
  of a dynamic algorithm update at each boundary step ≥ 1.

Parameter selection: an explicit ``param_filter`` / ``param_name_patterns`` replaces the default
filter entirely (it can select 1-D parameters); without one, ``configure``'s ``param_filter``
argument applies, and without that the default filter (``DEFAULT_PARAM_FILTER``: ndim > 1,
name without "embedding", "norm", "lm_head").
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from sparsity.base import SparsityAlgorithm, algorithm_names, get_algorithm_class
from sparsity.filters import DEFAULT_PARAM_FILTER, RegexParamFilter
from sparsity.group import Group
from sparsity.wrapper import SparsityWrapperOptimizer
from sparsity.schedules import (
    PiecewiseConstant,
    Schedule,
    UpdateSchedule,
    make_schedule,
    make_update_schedule,
)

__all__ = ["configure", "configure_sparsity_wrapper", "flatten_group"]

ParamFilter = str | Sequence[str] | Callable[[str, torch.Tensor], bool]

DEFAULT_ALGORITHM = "static"
# ModelZoo 1.x called static sparsity "sideband" (the masks rode along as a side band).
_LEGACY_ALGORITHM_NAMES = {"sideband": "static"}
# Keys configure() interprets itself; every other key must be a constructor parameter.
_CONFIG_KEYS = frozenset({"algorithm", "type", "schedule", "param_name_patterns", "sparsity_schedule",
                          "add_summaries"})
_CADENCE_KEYS = frozenset({"freq", "start", "stop", "steps"})


def configure(config: Any, *, param_filter: ParamFilter | None = None) -> SparsityAlgorithm:
    """Builds a :class:`~SparsityAlgorithm` (a :class:`~sparsity.Group` for several groups)
    from a raw config: a float, a dict, a list of group dicts, or ``{"groups": [...]}``.

    Both ModelZoo layouts are read: 2.x (``algorithm``, ``sparsity``, ``param_filter``,
    ``update``, ...) and 1.8/2.1 (``type``, ``schedule``, ``param_name_patterns``,
    ``sparsity_schedule``); every other key is a constructor argument of the algorithm.

    Args:
        config: A sparsity level (a ``Static`` at that level), a section dict, a list of
            section dicts (one group each, first match wins), or ``{"groups": [...]}``.
        param_filter: Replaces the default filter for every group that does not name its own.

    Returns:
        The algorithm, not yet applied to a model.

    Raises:
        ValueError: A bad key, name or value, with the key and its location in the message.
    """
    return _build(config, param_filter, "sparsity")


def configure_sparsity_wrapper(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: Any, **options: Any
) -> SparsityWrapperOptimizer:
    """Sparsifies ``model`` and returns a drop-in replacement for ``optimizer`` whose ``step()``
    keeps the masks and whose ``state_dict()`` / ``load_state_dict()`` carry the sparsity state.

    ``config`` is a raw config (see :func:`configure`), an algorithm built already, or, as
    cstorch 2.0 called it, an algorithm name with the options as keywords
    (``configure_sparsity_wrapper(model, opt, "rigl", sparsity=0.9, schedule=100,
    param_name_patterns=...)``). The algorithm is ``wrapper.algorithm`` either way (for metrics).
    """
    if isinstance(config, str):
        config = {"algorithm": config, **options}
    elif options:
        raise ValueError(f"configure_sparsity_wrapper: keyword options {sorted(options)} go with an "
                         "algorithm name as the third argument, not with a config")
    algorithm = config if isinstance(config, SparsityAlgorithm) else configure(config)
    algorithm.apply(model)
    return SparsityWrapperOptimizer(optimizer, algorithm)


def _build(config: Any, default_filter: ParamFilter | None, where: str) -> SparsityAlgorithm:
    if isinstance(config, bool) or not isinstance(config, (int, float, Mapping, list, tuple)):
        raise ValueError(
            f"{where}: expected a number, a dict or a list of group dicts, got "
            f"{type(config).__name__} {config!r}"
        )
    if isinstance(config, (int, float)):
        return _build({"sparsity": config}, default_filter, where)
    if isinstance(config, (list, tuple)):
        return _build_groups(config, {}, default_filter, where)
    if "groups" in config:
        defaults = {k: v for k, v in config.items() if k != "groups"}
        groups = [config["groups"]] if isinstance(config["groups"], Mapping) else config["groups"]
        if not isinstance(groups, (list, tuple)):
            raise ValueError(f"{where}.groups: expected a list of group dicts, got {groups!r}")
        return _build_groups(groups, defaults, default_filter, f"{where}.groups")
    if isinstance(config.get("param_name_patterns"), Mapping):
        return _build_pattern_groups(config, default_filter, where)
    return _build_algorithm(config, _param_filter(config, default_filter, where), where)


def _build_groups(
    entries: Sequence[Any], defaults: Mapping[str, Any], default_filter: ParamFilter | None, where: str
) -> Group:
    if not entries:
        raise ValueError(f"{where}: a list of groups needs at least one group")
    pairs = []
    for index, entry in enumerate(entries):
        here = f"{where}[{index}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{here}: each group must be a dict, got {type(entry).__name__} {entry!r}")
        merged = {**defaults, **flatten_group(entry)}
        if isinstance(merged.get("param_name_patterns"), Mapping):
            raise ValueError(f"{here}.param_name_patterns: a dict of patterns cannot sit inside a group")
        pairs.append(_filter_and_algorithm(merged, default_filter, here))
    return Group(pairs)


def flatten_group(entry: Mapping[str, Any]) -> dict[str, Any]:
    """ModelZoo's nested group, ``{"params": {...}, "param_filter": ...}``, as one flat dict
    (the ``params`` keys over the group's own), as cstorch's ``flatten_sparsity_params`` reads it."""
    params = entry.get("params", {})
    if not isinstance(params, Mapping):
        raise ValueError(f"a group's 'params' must be a dict of options, got {params!r}")
    return {**{k: v for k, v in entry.items() if k != "params"}, **params}


def _build_pattern_groups(
    config: Mapping[str, Any], default_filter: ParamFilter | None, where: str
) -> Group:
    """Legacy ``param_name_patterns: {regex: options}``: one group per pattern, in order."""
    top_level = {k: v for k, v in config.items() if k != "param_name_patterns"}
    pairs = []
    for pattern, options in config["param_name_patterns"].items():
        here = f"{where}.param_name_patterns[{pattern!r}]"
        if options is None:
            options = {}
        elif isinstance(options, (int, float)) and not isinstance(options, bool):
            options = {"sparsity": options}
        elif not isinstance(options, Mapping):
            raise ValueError(f"{here}: options must be a dict or a sparsity number, got {options!r}")
        merged = {**top_level, **options, "param_name_patterns": pattern}
        pairs.append(_filter_and_algorithm(merged, default_filter, here))
    if not pairs:
        raise ValueError(f"{where}.param_name_patterns: an empty dict selects no parameters")
    return Group(pairs)


def _filter_and_algorithm(
    config: Mapping[str, Any], default_filter: ParamFilter | None, where: str
) -> tuple[ParamFilter, SparsityAlgorithm]:
    """A group's (filter, algorithm); the algorithm gets the same filter, so both agree."""
    group_filter = _param_filter(config, default_filter, where)
    algorithm = _build_algorithm(config, group_filter, where)
    return (DEFAULT_PARAM_FILTER if group_filter is None else group_filter), algorithm


def _build_algorithm(
    config: Mapping[str, Any], param_filter: ParamFilter | None, where: str
) -> SparsityAlgorithm:
    cls = _algorithm_class(config, where)
    accepted = _constructor_keys(cls)
    unknown = sorted(set(config) - accepted - _CONFIG_KEYS)
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {unknown} for algorithm {cls.__name__.lower()!r}; "
            f"allowed: {sorted(accepted | _CONFIG_KEYS)}"
        )
    if not isinstance(config.get("add_summaries", False), bool):
        raise ValueError(f"{where}.add_summaries: expected true or false, got {config['add_summaries']!r}")
    kwargs = {k: v for k, v in config.items() if k not in _CONFIG_KEYS}
    sparsity_key, sparsity_value, cadence_key, cadence = _sparsity_and_cadence(config, where)
    if sparsity_key is not None:
        kwargs["sparsity"] = sparsity_value
    if cadence_key is not None:
        if "update" not in accepted:
            raise ValueError(
                f"{where}.{cadence_key}: algorithm {cls.__name__.lower()!r} never updates its masks, "
                "so it takes no update cadence"
            )
        kwargs["update"] = cadence
    if isinstance(sparsity_value, PiecewiseConstant):
        _add_boundary_updates(kwargs, sparsity_value, cls, accepted, where)
    if param_filter is not None:
        kwargs["param_filter"] = param_filter
    written_as = {"sparsity": sparsity_key or "sparsity", "update": cadence_key or "update"}
    _check_values(kwargs, written_as, where)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        # Keys were checked above, so this is a bad value; say where it sits in the config.
        raise ValueError(f"{where}: {err}") from err


def _algorithm_class(config: Mapping[str, Any], where: str) -> type:
    names = [config[k] for k in ("algorithm", "type") if k in config]
    if len(names) == 2 and names[0] != names[1]:
        raise ValueError(
            f"{where}: 'algorithm' ({names[0]!r}) and its alias 'type' ({names[1]!r}) disagree"
        )
    name = names[0] if names else DEFAULT_ALGORITHM
    if not isinstance(name, str):
        raise ValueError(
            f"{where}.algorithm: expected a name, one of {algorithm_names()}, got {name!r}"
        )
    name = _LEGACY_ALGORITHM_NAMES.get(name.lower(), name)  # case kept: may be module.ClassName
    try:
        cls = get_algorithm_class(name)
    except ValueError as err:
        raise ValueError(f"{where}.algorithm: {err}") from None
    if issubclass(cls, Group):
        raise ValueError(f"{where}.algorithm: write groups as a list of group dicts, not {name!r}")
    return cls


def _constructor_keys(cls: type) -> set[str]:
    """Keyword parameters of every ``__init__`` along the MRO (subclasses forward ``**base``)."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    keys: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]  # drop self
        keys.update(p.name for p in params if p.kind in named)
    return keys


def _is_cadence(value: Any) -> bool:
    """Legacy ``schedule``: an int ≥ 1 or a dict of freq/start/stop/steps is an update cadence."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 1
    if isinstance(value, UpdateSchedule):
        return True
    return isinstance(value, Mapping) and "type" not in value and bool(set(value) & _CADENCE_KEYS)


def _sparsity_and_cadence(config: Mapping[str, Any], where: str) -> tuple[str | None, Any, str | None, Any]:
    """Finds the one sparsity source and the one update cadence among the 2.x and legacy keys."""
    sparsity_sources, cadence_sources = {}, {}
    if "sparsity" in config:
        sparsity_sources["sparsity"] = config["sparsity"]
    if "schedule" in config:
        target = cadence_sources if _is_cadence(config["schedule"]) else sparsity_sources
        target["schedule"] = config["schedule"]
    if "sparsity_schedule" in config:
        try:
            piecewise = PiecewiseConstant(config["sparsity_schedule"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}.sparsity_schedule: expected [[step, value], ...]: {err}") from None
        _check_fraction([value for _, value in piecewise.points], f"{where}.sparsity_schedule", False)
        sparsity_sources["sparsity_schedule"] = piecewise
    if "update" in config:
        cadence_sources["update"] = config["update"]
    for what, sources in (("sparsity", sparsity_sources), ("update cadence", cadence_sources)):
        if len(sources) > 1:
            raise ValueError(f"{where}: {sorted(sources)} all give the {what}; keep one")
    sparsity_key, sparsity_value = next(iter(sparsity_sources.items()), (None, None))
    cadence_key, cadence = next(iter(cadence_sources.items()), (None, None))
    return sparsity_key, sparsity_value, cadence_key, cadence


def _add_boundary_updates(
    kwargs: dict[str, Any], schedule: PiecewiseConstant, cls: type, accepted: set[str], where: str
) -> None:
    """A legacy piecewise schedule changes the level at its boundaries: update the masks there."""
    boundaries = [step for step, _ in schedule.points if step >= 1]
    if not boundaries or "update" in kwargs:
        return
    if "update" not in accepted:
        raise ValueError(
            f"{where}.sparsity_schedule: the level changes at steps {boundaries}, but algorithm "
            f"{cls.__name__.lower()!r} never updates its masks; use a dynamic one such as 'gmp'"
        )
    kwargs["update"] = {"steps": boundaries}


def _param_filter(
    config: Mapping[str, Any], default_filter: ParamFilter | None, where: str
) -> ParamFilter | None:
    if "param_filter" in config and "param_name_patterns" in config:
        raise ValueError(f"{where}: give either 'param_filter' (globs) or 'param_name_patterns' (regexes)")
    if "param_name_patterns" in config:
        return RegexParamFilter(config["param_name_patterns"], f"{where}.param_name_patterns")
    value = config.get("param_filter", default_filter)
    if value is None or callable(value):
        return value
    globs = [value] if isinstance(value, str) else value
    if not (isinstance(globs, (list, tuple)) and globs and all(isinstance(g, str) for g in globs)):
        raise ValueError(
            f"{where}.param_filter: expected a glob or a non-empty list of globs, got {value!r}"
        )
    return value


def _check_values(kwargs: Mapping[str, Any], key_names: Mapping[str, str], where: str) -> None:
    """Checks the values configure() can judge alone, so errors name the key the user wrote."""
    for key, high_inclusive in (("sparsity", False), ("drop_fraction", True)):
        if key in kwargs:
            _check_fraction(kwargs[key], f"{where}.{key_names.get(key, key)}", high_inclusive)
    if "update" in kwargs:
        try:
            make_update_schedule(kwargs["update"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}.{key_names['update']}: {err}") from None
    if "seed" in kwargs and not _is_int(kwargs["seed"]):
        raise ValueError(f"{where}.seed: expected an integer, got {kwargs['seed']!r}")
    for key in ("balance_in_groups", "balance_out_groups"):
        value = kwargs.get(key)
        if value is not None and not (_is_int(value) and value >= 1):
            raise ValueError(f"{where}.{key}: expected an integer >= 1 or null, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fraction(value: Any, key: str, high_inclusive: bool) -> None:
    """A sparsity-like value: a number in [0, 1) (``drop_fraction``: [0, 1]) or a schedule."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected a number or a schedule, got {value!r}")
    if isinstance(value, (int, float)):
        in_range = 0.0 <= value <= 1.0 if high_inclusive else 0.0 <= value < 1.0
        if math.isnan(value) or not in_range:
            bound = "[0, 1]" if high_inclusive else "[0, 1)"
            raise ValueError(f"{key}: expected a value in {bound}, got {value!r}")
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_fraction(item, key, high_inclusive)
        return
    if isinstance(value, (Mapping, Schedule)) or callable(value):
        try:
            make_schedule(value)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{key}: {err}") from None
        return
    raise ValueError(f"{key}: expected a number, a schedule dict, a list or a callable, got {value!r}")
