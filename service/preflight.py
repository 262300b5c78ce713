"""Torch-free checks of a raw params dict, run on every submission before anything is stored.

sparsity.configure (which imports torch) does the full check later, in the VALIDATING step; these
catch what must never reach it or a worker: a sparsity level outside [0, 1) or NaN, an unknown
algorithm or schedule name, a regex whose matching time is not bounded, a data path outside the
allowed roots. The sparsity section is walked the way `configure` reads it (top-level keys are
defaults merged into every group; a legacy `param_name_patterns` dict makes one group per
pattern), so a value cannot slip past by sitting where this walk does not look. Each problem is
a (location, message) pair so the API answers 422 naming the field. Every function here is
total: any JSON/YAML value gives problems, never an exception.
"""

from __future__ import annotations

import math
import os
import re
import re._parser as sre_parse  # the stdlib's own regex parser; no public API exposes the tree
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

Loc = tuple[str | int, ...]
Problem = tuple[Loc, str]
# Kept in sync with sparsity.algorithm_names() / sparsity.schedules.schedule_names() by a test:
# importing sparsity here would import torch into the API process.
ALGORITHM_NAMES = ("gmp", "granet", "rigl", "set", "static")
LEGACY_ALGORITHM_NAMES = ("sideband",)  # ModelZoo 1.x's "static"
SCHEDULE_NAMES = (
    "constant", "cosine", "cubic", "cycling", "exp", "lambda", "linear", "periodic",
    "piecewiseconstant", "polynomial", "power",
)
# Data sets named `builtin:<name>`; kept in sync with training.text by a test.
BUILTIN_DATA_SETS = ("shakespeare",)
# Integers that size a job's time or memory, with the largest each may be: far beyond any run
# here (the memory admission bounds the model), short of one that never ends. max_steps allows
# what ModelZoo publishes (up to 1.4e9 steps in 1.x Llama files); the job's timeout_s bounds
# how long any run holds its systems.
WORK_LIMITS: dict[Loc, int] = {
    ("runconfig", "max_steps"): 2**31 - 1,
    ("runconfig", "eval_steps"): 1_000_000,
    ("train_input", "batch_size"): 65_536,
    ("eval_input", "batch_size"): 65_536,
    ("train_input", "max_sequence_length"): 1_048_576,
    ("eval_input", "max_sequence_length"): 1_048_576,
    ("model", "tokenizer", "vocab_size"): 1_048_576,
}
MAX_REGEX_CHARS = 256
MAX_PATTERNS = 64
# Regex matching time: CPython's `re` backtracks and holds the GIL for a whole match, so a
# pattern is accepted only if its backtracking is provably bounded on a parameter name of up
# to NAME_CHARS characters (names of the models here are far shorter): no repetition nested in
# another, and (alternatives and optional parts multiplied) × NAME_CHARS ** (variable-length
# repetitions) at most NAME_CHARS ** 3, which one `re.search` runs in milliseconds.
NAME_CHARS = 128
MAX_BACKTRACKING = NAME_CHARS ** 3
_CADENCE_KEYS = frozenset({"freq", "start", "stop", "steps"})


def check_params(params: Mapping[str, Any], *,
                 allowed_data_roots: Sequence[Path]) -> list[Problem]:
    problems = work_problems(params)
    if params.get("sparsity") is not None:
        problems += check_sparsity(params["sparsity"], ("sparsity",))
    for section in ("train_input", "eval_input"):
        inputs = params.get(section)
        if not isinstance(inputs, Mapping):
            continue
        problems += _data_dir_problems(inputs.get("data_dir"), (section, "data_dir"), allowed_data_roots)
        mixture = inputs.get("mixture")  # ModelZoo's weighted data sets, each with its data_dir
        for index, entry in enumerate(mixture if isinstance(mixture, list) else []):
            if isinstance(entry, Mapping):
                problems += _data_dir_problems(entry.get("data_dir"), (section, "mixture", index, "data_dir"),
                                               allowed_data_roots)
    return problems


def _data_dir_problems(data_dir: Any, loc: Loc, allowed_data_roots: Sequence[Path]) -> list[Problem]:
    """A data_dir's folders outside the allowed roots; ModelZoo allows one folder or a list."""
    problems = []
    for index, path in enumerate(data_dir if isinstance(data_dir, list) else [data_dir]):
        if path is None and not isinstance(data_dir, list):
            continue
        message = check_data_dir(path, allowed_data_roots)
        if message:
            problems.append(((*loc, *((index,) if isinstance(data_dir, list) else ())), message))
    return problems


def work_problems(params: Mapping[str, Any]) -> list[Problem]:
    """Integers that size a job's work beyond WORK_LIMITS (the schema takes any positive int)."""
    problems: list[Problem] = []
    for loc, limit in WORK_LIMITS.items():
        value: Any = params
        for key in loc:
            value = value.get(key) if isinstance(value, Mapping) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            problems.append((loc, f"at most {limit:,}, got {_short(value)}"))
    return problems


def check_data_dir(data_dir: Any, allowed_roots: Sequence[Path]) -> str | None:
    """Why `data_dir` is refused, or None: a built-in data set or a folder under a root."""
    if not isinstance(data_dir, str):
        return f"data_dir must be a string, got {type(data_dir).__name__}"
    if data_dir.startswith("builtin:"):
        name = data_dir.removeprefix("builtin:")
        if name in BUILTIN_DATA_SETS:
            return None
        return (f"unknown built-in data set {name[:100]!r}; known: "
                f"{['builtin:' + n for n in BUILTIN_DATA_SETS]}")
    resolved = resolve_path(data_dir)
    roots = [resolve_path(str(r)) for r in allowed_roots]
    if resolved is not None and any(r is not None and is_within(resolved, r) for r in roots):
        return None
    allowed = ", ".join(["builtin:<name>", *(str(r) for r in roots if r is not None)])
    return f"data_dir {data_dir[:200]!r} is outside the allowed data roots ({allowed})"


def resolve_path(text: str, base: Path | None = None) -> Path | None:
    """`text` as an absolute path with symlinks resolved, or None if it cannot name a file.
    `~` is not expanded: the server's home directories are nobody's business over REST."""
    if not text or "\x00" in text or len(text) > os.pathconf("/", "PC_PATH_MAX"):
        return None
    try:
        return ((base or Path.cwd()) / text).resolve()
    except (OSError, RuntimeError, ValueError):
        return None


def is_within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


# ---- sparsity, walked as sparsity.configure reads it ---------------------------------------
def check_sparsity(value: Any, loc: Loc) -> list[Problem]:
    if isinstance(value, bool) or not isinstance(value, int | float | Mapping | list):
        return [(loc, f"expected a number, a dict or a list of group dicts, got "
                      f"{type(value).__name__}")]
    if isinstance(value, int | float):
        return list(_check_level(value, loc))
    if isinstance(value, list):
        return _check_groups(value, {}, loc)
    if "groups" in value:
        defaults = {key: (item, (*loc, key)) for key, item in value.items() if key != "groups"}
        if not isinstance(value["groups"], list):
            return [((*loc, "groups"), "expected a list of group dicts")]
        # The defaults on their own too: a bad one is refused even where every group overrides
        # it. A default reported through each group that inherits it is reported once.
        problems = _check_group(defaults) + _check_groups(value["groups"], defaults,
                                                          (*loc, "groups"))
        return list(dict.fromkeys(problems))
    located = {key: (item, (*loc, key)) for key, item in value.items()}
    if isinstance(value.get("param_name_patterns"), Mapping):
        return _check_pattern_groups(located, loc)
    return _check_group(located)


# A group as configure sees it after merging: key -> (value, where the user wrote it).
Located = dict[Any, tuple[Any, Loc]]


def _check_groups(entries: list[Any], defaults: Located, loc: Loc) -> list[Problem]:
    if not entries:
        return [(loc, "a list of groups needs at least one group")]
    problems: list[Problem] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            problems.append(((*loc, index), f"each group must be a dict, got "
                                            f"{type(entry).__name__}"))
            continue
        merged = {**defaults, **{k: (v, (*loc, index, k)) for k, v in entry.items()}}
        patterns, where = merged.get("param_name_patterns", (None, ()))
        if isinstance(patterns, Mapping):
            problems.append((where, "a dict of patterns cannot sit inside a group"))
            continue
        problems += _check_group(merged)
    return problems


def _check_pattern_groups(located: Located, loc: Loc) -> list[Problem]:
    """Legacy `param_name_patterns: {regex: options}`: one group per pattern, options override
    the top-level keys; a bare number as options is its sparsity."""
    patterns, where = located.pop("param_name_patterns")
    if not patterns:
        return [(where, "an empty dict selects no parameters")]
    if len(patterns) > MAX_PATTERNS:
        return [(where, f"at most {MAX_PATTERNS} patterns, got {len(patterns)}")]
    problems: list[Problem] = []
    for pattern, options in patterns.items():
        here = (*where, str(pattern)[:MAX_REGEX_CHARS])
        problems += [(here, message) for message in [regex_problem(pattern)] if message]
        if options is None:
            options_located: Located = {}
        elif isinstance(options, int | float) and not isinstance(options, bool):
            options_located = {"sparsity": (options, here)}
        elif isinstance(options, Mapping):
            options_located = {k: (v, (*here, k)) for k, v in options.items()}
        else:
            problems.append((here, f"options must be a dict or a sparsity number, got "
                                   f"{type(options).__name__}"))
            continue
        merged = {**located, **options_located}
        merged.pop("param_name_patterns", None)  # the pattern itself was checked above
        problems += _check_group(merged)
    return problems


def _check_group(group: Located) -> list[Problem]:
    problems: list[Problem] = []
    for key in ("algorithm", "type"):
        if key in group:
            name, where = group[key]
            known = (*ALGORITHM_NAMES, *LEGACY_ALGORITHM_NAMES)
            if not isinstance(name, str) or name.lower() not in known:
                problems.append((where, f"unknown algorithm {_short(name)}; known: "
                                        f"{list(ALGORITHM_NAMES)}"))
    # `schedule` is the sparsity unless it reads as an update cadence (configure._is_cadence).
    for key in ("sparsity", "schedule", "init_sparsity"):
        if key in group and not (key == "schedule" and _is_cadence(group[key][0])):
            problems += _check_level(*group[key])
    if "drop_fraction" in group:
        problems += _check_level(*group["drop_fraction"], upper_open=False)
    if "sparsity_schedule" in group:
        points, where = group["sparsity_schedule"]
        if not isinstance(points, list):
            problems.append((where, "expected [[step, value], ...]"))
        else:
            for i, point in enumerate(points):
                if isinstance(point, list) and len(point) == 2:
                    problems += _check_level(point[1], (*where, i, 1))
                else:
                    problems.append(((*where, i), "expected a [step, value] pair"))
    if "param_name_patterns" in group:
        problems += _check_pattern_list(*group["param_name_patterns"])
    return problems


def _check_pattern_list(patterns: Any, where: Loc) -> list[Problem]:
    if isinstance(patterns, str):
        message = regex_problem(patterns)
        return [(where, message)] if message else []
    if not isinstance(patterns, list) or not patterns:
        return [(where, "expected a regex, a non-empty list of regexes or a dict")]
    if len(patterns) > MAX_PATTERNS:
        return [(where, f"at most {MAX_PATTERNS} patterns, got {len(patterns)}")]
    return [((*where, i), message) for i, pattern in enumerate(patterns)
            for message in [regex_problem(pattern)] if message]


def _is_cadence(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 1
    return isinstance(value, Mapping) and "type" not in value and bool(set(value) & _CADENCE_KEYS)


def _check_level(value: Any, loc: Loc, *, upper_open: bool = True) -> Iterator[Problem]:
    """A level is a number in [0, 1) (drop fractions may be 1), a list of them, or a schedule."""
    if isinstance(value, bool):
        yield loc, f"must be a number in [0, 1), got {value!r}"
    elif isinstance(value, int | float):
        nan = isinstance(value, float) and math.isnan(value)
        bad = nan or value < 0 or (value >= 1 if upper_open else value > 1)
        if bad:
            interval = "[0, 1)" if upper_open else "[0, 1]"
            yield loc, f"must be a finite number in {interval}, got {_short(value)}"
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _check_level(v, (*loc, i), upper_open=upper_open)
    elif isinstance(value, Mapping):
        kind = value.get("type")
        if not isinstance(kind, str) or kind.lower() not in SCHEDULE_NAMES:
            yield ((*loc, "type"),
                   f"unknown schedule type {_short(kind)}; known: {list(SCHEDULE_NAMES)}")
        for key in ("value", "init", "final", "minimum", "init_sparsity", "end_sparsity"):
            if key in value:
                yield from _check_level(value[key], (*loc, key), upper_open=upper_open)
    else:
        yield loc, f"must be a number in [0, 1) or a schedule dict, got {type(value).__name__}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


# ---- regexes ---------------------------------------------------------------------------------
def regex_problem(pattern: Any) -> str | None:
    """Why `pattern` is refused, or None: see MAX_BACKTRACKING for what is accepted."""
    if not isinstance(pattern, str):
        return f"a regex must be a string, got {type(pattern).__name__}"
    if len(pattern) > MAX_REGEX_CHARS:
        return f"regex longer than {MAX_REGEX_CHARS} characters ({len(pattern)})"
    try:
        tree = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError) as err:
        return f"invalid regex {pattern!r}: {err}"
    if _has_nested_repeat(tree, inside_repeat=False):
        return (
            f"regex {pattern!r} nests a repetition (or a repeated alternation/backreference) "
            "inside another repetition, which can backtrack catastrophically"
        )
    if _backtracking(tree) > MAX_BACKTRACKING:
        return (f"regex {pattern!r} has too many variable-length repetitions, alternatives or "
                "optional parts in a row: matching it could backtrack for seconds")
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


def _backtracking(tree: Any) -> int:
    """A cost bound for a pattern without nested repetitions on a name of NAME_CHARS
    characters: each variable-length repetition may end at any of NAME_CHARS places; an
    optional part or an alternation multiplies by twice its number of choices (each choice
    also costs the steps re-run after it, which measured about that much more than a split
    of a `.*`)."""
    ways = 1
    for op, arg in tree:
        if op in _REPEATS:
            low, high, sub = arg
            rounds = NAME_CHARS if high is sre_parse.MAXREPEAT else min(high, NAME_CHARS)
            ends = NAME_CHARS if rounds - low > 1 else 4 if rounds != low else 1
            ways *= ends * _backtracking(sub) ** rounds  # each round picks among sub's ways
        elif op is sre_parse.BRANCH:
            ways *= 2 * sum(_backtracking(branch) for branch in arg[1])
        elif op is sre_parse.SUBPATTERN:
            ways *= _backtracking(arg[-1])
        elif op in (sre_parse.ASSERT, sre_parse.ASSERT_NOT):
            ways *= _backtracking(arg[1])
        elif op is sre_parse.GROUPREF_EXISTS:
            ways *= 2 * sum(_backtracking(branch) for branch in arg[1:] if branch is not None)
        ways = min(ways, MAX_BACKTRACKING + 1)  # saturate: only "over the bound" matters
    return ways
