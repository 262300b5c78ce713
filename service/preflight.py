"""Torch-free checks of a params dict, run on every submission before anything is stored.

sparsity.configure (which imports torch) does the full check later, in the VALIDATING step; these
catch what must never reach a worker: a sparsity level outside [0, 1) or NaN, an unknown
algorithm or schedule name, a regex that can backtrack catastrophically, a data path outside the
allowed roots. Each problem is a (location, message) pair so the API answers 422 naming the field.
"""

from __future__ import annotations

import math
import re
import re._parser as sre_parse  # the stdlib's own regex parser; no public API exposes the tree
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# Kept in sync with sparsity.algorithm_names() / sparsity.schedules.schedule_names() by a test:
# importing sparsity here would import torch into the API process.
ALGORITHM_NAMES = ("gmp", "granet", "rigl", "set", "static")
SCHEDULE_NAMES = (
    "constant", "cosine", "cubic", "cycling", "exp", "lambda", "linear", "piecewiseconstant",
    "polynomial", "power",
)
MAX_REGEX_CHARS = 256
Loc = tuple[str | int, ...]
Problem = tuple[Loc, str]


def check_params(params: dict[str, Any], *, allowed_data_roots: Sequence[Path]) -> list[Problem]:
    problems: list[Problem] = []
    if "sparsity" in params and params["sparsity"] is not None:
        problems += _check_sparsity_section(params["sparsity"], ("sparsity",))
    for section in ("train_input", "eval_input"):
        data_dir = (params.get(section) or {}).get("data_dir")
        if isinstance(data_dir, str):
            message = check_data_dir(data_dir, allowed_data_roots)
            if message:
                problems.append(((section, "data_dir"), message))
    return problems


def check_data_dir(data_dir: str, allowed_roots: Sequence[Path]) -> str | None:
    if data_dir.startswith("builtin:"):
        return None
    resolved = Path(data_dir).expanduser().resolve()
    roots = [Path(r).expanduser().resolve() for r in allowed_roots]
    if any(resolved == root or root in resolved.parents for root in roots):
        return None
    allowed = ", ".join(["builtin:<name>", *map(str, roots)])
    return f"data_dir {data_dir!r} is outside the allowed data roots ({allowed})"


def _check_sparsity_section(value: Any, loc: Loc) -> list[Problem]:
    if isinstance(value, dict) and "groups" in value:
        value = value["groups"]
        loc = (*loc, "groups")
    if isinstance(value, list):
        if all(isinstance(v, dict) for v in value):
            return [p for i, group in enumerate(value) for p in _check_group(group, (*loc, i))]
        return list(_check_level(value, loc))
    if isinstance(value, dict):
        return _check_group(value, loc)
    return list(_check_level(value, loc))


def _check_group(group: dict[str, Any], loc: Loc) -> list[Problem]:
    problems: list[Problem] = []
    name = group.get("algorithm", group.get("type"))
    if name is not None and str(name).lower() not in ALGORITHM_NAMES:
        key = "algorithm" if "algorithm" in group else "type"
        message = f"unknown algorithm {name!r}; known: {list(ALGORITHM_NAMES)}"
        problems.append(((*loc, key), message))
    # In the 2.x layout `schedule` is an alias of `sparsity`; beside `sparsity` it is a cadence.
    level_key = "sparsity" if "sparsity" in group else "schedule" if "schedule" in group else None
    if level_key == "schedule" and not _looks_like_level(group["schedule"]):
        level_key = None
    if level_key is not None:
        problems += _check_level(group[level_key], (*loc, level_key))
    if "init_sparsity" in group:
        problems += _check_level(group["init_sparsity"], (*loc, "init_sparsity"))
    for i, point in enumerate(group.get("sparsity_schedule") or []):
        if isinstance(point, list | tuple) and len(point) == 2:
            problems += _check_level(point[1], (*loc, "sparsity_schedule", i, 1))
    if "drop_fraction" in group:
        problems += _check_level(group["drop_fraction"], (*loc, "drop_fraction"), upper_open=False)
    patterns = group.get("param_name_patterns")
    if isinstance(patterns, dict):
        for pattern, options in patterns.items():
            problems += _check_regex(pattern, (*loc, "param_name_patterns", pattern))
            if isinstance(options, dict):
                problems += _check_group(options, (*loc, "param_name_patterns", pattern))
            else:
                problems += _check_level(options, (*loc, "param_name_patterns", pattern))
    elif isinstance(patterns, list):
        for i, pattern in enumerate(patterns):
            problems += _check_regex(pattern, (*loc, "param_name_patterns", i))
    elif patterns is not None:
        problems += _check_regex(patterns, (*loc, "param_name_patterns"))
    return problems


def _looks_like_level(value: Any) -> bool:
    if isinstance(value, float):
        return True
    return isinstance(value, dict) and "type" in value


def _check_level(value: Any, loc: Loc, *, upper_open: bool = True) -> Iterator[Problem]:
    """A level is a number in [0, 1) (drop fractions may be 1), a list of them, or a schedule."""
    if isinstance(value, bool):
        yield loc, f"must be a number in [0, 1), got {value!r}"
    elif isinstance(value, int | float):
        bad = math.isnan(value) or value < 0 or (value >= 1 if upper_open else value > 1)
        if bad:
            interval = "[0, 1)" if upper_open else "[0, 1]"
            yield loc, f"must be a finite number in {interval}, got {value!r}"
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _check_level(v, (*loc, i), upper_open=upper_open)
    elif isinstance(value, dict):
        kind = value.get("type")
        if kind is None or str(kind).lower() not in SCHEDULE_NAMES:
            yield (*loc, "type"), f"unknown schedule type {kind!r}; known: {list(SCHEDULE_NAMES)}"
        for key in ("value", "init", "final", "minimum", "init_sparsity", "end_sparsity"):
            if key in value:
                yield from _check_level(value[key], (*loc, key), upper_open=upper_open)
    else:
        yield loc, f"must be a number in [0, 1) or a schedule dict, got {type(value).__name__}"


def _check_regex(pattern: Any, loc: Loc) -> list[Problem]:
    message = regex_problem(pattern)
    return [(loc, message)] if message else []


def regex_problem(pattern: Any) -> str | None:
    """Why `pattern` is refused, or None. Refuses patterns that can backtrack exponentially."""
    if not isinstance(pattern, str):
        return f"a regex must be a string, got {type(pattern).__name__}"
    if len(pattern) > MAX_REGEX_CHARS:
        return f"regex longer than {MAX_REGEX_CHARS} characters ({len(pattern)})"
    try:
        tree = sre_parse.parse(pattern)
    except re.error as err:
        return f"invalid regex {pattern!r}: {err}"
    if _has_nested_repeat(tree, inside_repeat=False):
        return (
            f"regex {pattern!r} nests a repetition (or a repeated alternation/backreference) "
            "inside another repetition, which can backtrack catastrophically"
        )
    return None


_REPEATS = {sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, sre_parse.POSSESSIVE_REPEAT}


def _has_nested_repeat(tree: Any, *, inside_repeat: bool) -> bool:
    for op, arg in tree:
        if op in _REPEATS:
            low, high, sub = arg
            repeats = high is sre_parse.MAXREPEAT or high > 1
            if repeats and inside_repeat:
                return True
            if _has_nested_repeat(sub, inside_repeat=inside_repeat or repeats):
                return True
        elif op is sre_parse.BRANCH:
            if inside_repeat:
                return True
            if any(_has_nested_repeat(b, inside_repeat=False) for b in arg[1]):
                return True
        elif op is sre_parse.SUBPATTERN:
            if _has_nested_repeat(arg[-1], inside_repeat=inside_repeat):
                return True
        elif op in (sre_parse.GROUPREF, sre_parse.GROUPREF_EXISTS) and inside_repeat:
            return True
        elif op in (sre_parse.ASSERT, sre_parse.ASSERT_NOT):
            if _has_nested_repeat(arg[1], inside_repeat=inside_repeat):
                return True
    return False
