"""User code for configs: ``csx run --python_paths DIR ...`` makes ``algorithm: MyAlgo`` work.

The folders go on ``sys.path`` and into ``CSX_PYTHON_PATHS`` (inherited by worker processes).
A config naming an algorithm no imported class registers makes :func:`get_algorithm_class`
import the modules of those folders once (their ``SparsityAlgorithm`` subclasses register on
import) and look again; ``module.ClassName`` names a class in one module directly. Only the CLI
sets these folders: a job submitted over the REST API never imports code.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["ENV_VAR", "add_python_paths", "import_python_paths", "import_from_env"]

ENV_VAR = "CSX_PYTHON_PATHS"
_imported: set[str] = set()


def add_python_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Checks the folders, puts them on ``sys.path`` and in ``CSX_PYTHON_PATHS``; returns them."""
    folders = [Path(p).resolve() for p in paths]
    missing = [str(f) for f in folders if not f.is_dir()]
    if missing:
        raise ValueError(f"--python_paths: not a folder: {missing}")
    known = [p for p in os.environ.get(ENV_VAR, "").split(os.pathsep) if p]
    for folder in folders:
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
        if str(folder) not in known:
            known.append(str(folder))
    os.environ[ENV_VAR] = os.pathsep.join(known)
    return folders


def import_python_paths(paths: Iterable[str | Path]) -> list[str]:
    """Imports every module (``*.py``) and package of each folder, except names starting with
    ``_`` or ``test``; returns the module names imported by this call."""
    names = []
    for folder in add_python_paths(paths):
        for entry in sorted(folder.iterdir()):
            is_module = entry.suffix == ".py" and entry.is_file()
            is_package = (entry / "__init__.py").is_file()
            name = entry.stem if is_module else entry.name
            if (is_module or is_package) and not name.startswith(("_", "test")) and name not in _imported:
                importlib.import_module(name)
                _imported.add(name)
                names.append(name)
    return names


def import_from_env() -> list[str]:
    """Imports the modules of the folders in ``CSX_PYTHON_PATHS`` (none if unset)."""
    paths = [p for p in os.environ.get(ENV_VAR, "").split(os.pathsep) if p]
    return import_python_paths(paths) if paths else []
