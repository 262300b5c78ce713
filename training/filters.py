"""Sparsity groups and parameter patterns that select no parameter of the model.

A group that selects nothing is an error (``checked_groups``); one pattern of a group's list
that selects nothing is only a warning, since the group still works, but it is how a file
written for another release's parameter names goes wrong without a word (ModelZoo 2.3's
``*linear_layer.expert_weights`` on another layout's experts). The patterns are read where
``sparsity.configure`` reads them: ``param_filter`` (fnmatch globs on the full name) and the
legacy ``param_name_patterns`` (regexes, ``re.search``), at the top, in each group of a list
or of ``groups``, and as the keys of a ``param_name_patterns`` dict.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any


def _patterns(config: Any, where: str) -> Iterator[tuple[str, str, bool]]:
    """(location, pattern, is_regex) of every pattern the section names."""
    if isinstance(config, (list, tuple)):
        for index, group in enumerate(config):
            yield from _patterns(group, f"{where}[{index}]")
        return
    if not isinstance(config, Mapping):
        return
    if isinstance(config.get("groups"), (list, tuple)):
        yield from _patterns(config["groups"], f"{where}.groups")
    globs, regexes = config.get("param_filter"), config.get("param_name_patterns")
    for pattern in [globs] if isinstance(globs, str) else globs if isinstance(globs, (list, tuple)) else []:
        yield f"{where}.param_filter", pattern, False
    if isinstance(regexes, Mapping):
        regexes = list(regexes)
    for pattern in [regexes] if isinstance(regexes, str) else regexes if isinstance(regexes, (list, tuple)) else []:
        yield f"{where}.param_name_patterns", pattern, True


def unmatched_patterns(section: Any, names: Iterable[str]) -> list[str]:
    """A warning for each pattern of the sparsity ``section`` that no name in ``names`` (the
    model's parameters) matches, naming the pattern."""
    names = list(names)
    warnings = []
    for where, pattern, is_regex in dict.fromkeys(_patterns(section, "sparsity")):
        if not isinstance(pattern, str):
            continue  # configure refuses it
        try:
            matches = (re.compile(pattern).search if is_regex else
                       lambda name, glob=pattern: fnmatch.fnmatchcase(name, glob))
        except re.error:
            continue  # configure refuses it, naming the regex
        if not any(matches(name) for name in names):
            warnings.append(f"{where}: pattern {pattern!r} matches no parameter of this model, so it "
                            "selects nothing (the parameter names: csx run --validate_only --logging DEBUG)")
    return warnings


def checked_groups(alg: Any) -> list[dict[str, Any]]:
    """Each group of an applied algorithm with the parameters it sparsifies; a group that
    matches no parameter is a ValueError (it would train dense without a word)."""
    groups = []
    for index, member in enumerate(getattr(alg, "members", [alg])):
        names = [name for name, _, _ in member.sparse_parameters()]
        if not names:
            raise ValueError(f"sparsity group {index} ({type(member).__name__.lower()}) matches no "
                             "parameter: check its param_filter / param_name_patterns against the "
                             "model's parameter names (csx run --validate_only --logging DEBUG lists them)")
        groups.append({"group": index, "algorithm": type(member).__name__.lower(), "parameters": names})
    return groups
