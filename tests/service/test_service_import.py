"""The API process stays torch-free at import; its torch-free name lists match the library."""

from __future__ import annotations

import subprocess
import sys

import pytest

from service.preflight import ALGORITHM_NAMES, BUILTIN_DATA_SETS, SCHEDULE_NAMES, regex_problem


def test_service_main_imports_without_torch() -> None:
    code = "import sys, service.main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_name_lists_match_the_sparsity_registries() -> None:
    import sparsity
    from sparsity.schedules import schedule_names

    # Other tests register their own subclasses; compare the library's built-in names.
    builtin = [n for n in sparsity.algorithm_names()
               if sparsity.get_algorithm_class(n).__module__.startswith("sparsity.")]
    assert sorted(ALGORITHM_NAMES) == builtin
    builtin_schedules = [n for n in schedule_names()
                         if sparsity.schedules.Schedule.registry[n].__module__.startswith("sparsity.")]
    assert sorted(SCHEDULE_NAMES) == builtin_schedules


def test_builtin_data_set_names_match_the_workers() -> None:
    from training import text

    builtin = sorted(v.removeprefix("builtin:") for k, v in vars(text).items()
                     if k.startswith("BUILTIN_") and isinstance(v, str))
    assert sorted(BUILTIN_DATA_SETS) == builtin


@pytest.mark.parametrize("pattern", [r"(a+)+$", r"(a|aa)*b", r"(x*)*", r"^(\w+\s?)*$",
                                     r"(.*a){2,}", r"(a)\1*" * 1, "a" * 300, "(unclosed"])
def test_dangerous_or_broken_regexes_are_refused(pattern: str) -> None:
    assert regex_problem(pattern) is not None


@pytest.mark.parametrize("pattern", [r"layers\.\d+\.mlp\.fc[12]\.weight", r".*attn.*",
                                     r"^(?:encoder|decoder)\.", r"(?:ab)+c", r"x{2,5}y"])
def test_ordinary_regexes_pass(pattern: str) -> None:
    assert regex_problem(pattern) is None
