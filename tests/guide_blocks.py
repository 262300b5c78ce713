"""The guide's code blocks, as a reader meets them: README.md, then every page of mkdocs.yml's
navigation in order. Used by tests/test_docs.py (build, classification, the fast blocks) and
tests/test_readme.py (the blocks that train or talk to a service, against a local stack).

Every fenced block names its language; each language is run, or not, for a stated reason
(`LANGUAGES`). Every line of a shell block is classified (`LINE_KINDS`); an unclassified line
fails the suite, so a new command in the guide gets a decision here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_API = "http://127.0.0.1:8000"
ACTIVATE = "source .venv/bin/activate"
VENV_BIN = Path(sys.prefix) / "bin"
FENCE = re.compile(r"^```(\S*)\n(.*?)^```", flags=re.S | re.M)

# language -> (what the tests do with it, why)
LANGUAGES: dict[str, tuple[str, str]] = {
    "bash": ("run", "each line classified in LINE_KINDS"),
    "python": ("run", "run as a script, in the guide's order"),
    "yaml": ("run", "a `sparsity:` section goes through sparsity.configure"),
    "text": ("skip", "a picture or a formula, not a command"),
}

# (pattern on the whole line, kind, why). First match wins. Kinds: "skip" is not run here (the
# reason says what covers it), "activate" is the prefix of every other line, "quick" runs in the
# fast test, "stack" lines run in the slow test in guide order against a local stack,
# "provided" lines are what that stack itself does, "server" lines start a server that is
# polled, then stopped.
LINE_KINDS: list[tuple[str, str, str]] = [
    (r"make run", "skip", "minutes: `csx local-study` on examples/study_baby_gpt.yaml, run on a tiny "
                          "study by tests/service/test_service_local_stack.py"),
    (r"make test", "skip", "this suite"),
    (r"make (results|bench)", "skip", "hours: benchmarks and docs/results.md"),
    (r"make gpu-(check|bundle) NANOGPT=\S+", "skip",
     "a GPU, and the network for the bundle: tests/test_gpu_check.py runs the check's CPU side, "
     "its CUDA-torch step and the bundle's offline install"),
    (r"sh tools/gpu_device_check\.sh", "skip", "on a GPU machine without network, after make gpu-bundle"),
    (r"git worktree add .*|python research/rigl_cause\.py .*", "skip",
     "hours: the recipe behind docs/results.md's cause table, its outputs kept in research/results/"),
    (r"docker compose .*", "skip", "needs a Docker engine: tests/service/test_service_topology.py "
                                   "runs the same topology as processes, test_service_compose.py "
                                   "checks the file"),
    (r"export CSX_MLFLOW_ADMIN_PASSWORD=.*", "skip",
     "the compose stack's secrets: tests/service/test_service_topology.py runs its MLflow with "
     "basic auth and a generated admin password"),
    (r"ray start .*|RAY_ADDRESS=\S+ .*csx serve .*", "skip",
     "a Ray cluster over several hosts: tests/service/test_service_topology.py starts the same "
     "head, API node and service on one host"),
    (re.escape(ACTIVATE), "activate", "sourced before every other line"),
    (r"csx( \S+)? --help", "quick", ""),
    (r"csx run .* --validate_only", "quick", "meta-device plan, seconds"),
    (r"csx convert .*", "quick", ""),
    (r"csx serve --dev-token &", "provided", "the stack runs it on a free port"),
    (r"export CSX_TOKEN=csx_\.\.\.", "provided", "the stack reads the printed token"),
    (r"csx (preprocess|run|finalize|submit|study) .*", "stack", "trains: tiny copies, 4 steps"),
    (r"curl .*", "stack", "the service's REST API"),
    (r"mlflow ui .*", "server", "runs until stopped"),
]


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    language: str
    text: str


def nav_pages() -> list[str]:
    """The site's pages in navigation order, relative to docs/."""
    def walk(entry) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, list):
            return [page for item in entry for page in walk(item)]
        return [page for value in entry.values() for page in walk(value)]

    return walk(yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"])


def guide_pages() -> list[Path]:
    return [ROOT / "README.md"] + [DOCS / page for page in nav_pages()]


def code_blocks(pages: list[Path] | None = None) -> list[Block]:
    return [Block(str(page.relative_to(ROOT)), language, text)
            for page in (pages or guide_pages())
            for language, text in FENCE.findall(page.read_text(encoding="utf-8"))]


def blocks(language: str) -> list[Block]:
    return [block for block in code_blocks() if block.language == language]


def commands(block: str) -> list[str]:
    """Lines of a shell block without their trailing comments."""
    return [re.sub(r"\s+#.*$", "", line).strip() for line in block.strip().splitlines()]


def shell_blocks() -> list[list[str]]:
    return [commands(block.text) for block in blocks("bash")]


def kind_of(line: str) -> str | None:
    return next((kind for pattern, kind, _ in LINE_KINDS if re.fullmatch(pattern, line)), None)


def lines_of(*kinds: str) -> list[str]:
    """Guide lines of these kinds, in guide order, each once (a page repeats what the README
    shows); a block holding a "stack" line runs whole in the slow test (its lines depend on
    each other), so its quick lines go there too."""
    found: list[str] = []
    seen: set[str] = set()
    for block in shell_blocks():
        block_kinds = {kind_of(line) for line in block}
        for line in block:
            kind = kind_of(line)
            if kind == "quick" and "stack" in block_kinds:
                kind = "stack"
            if kind in kinds and line not in seen:
                found.append(line)
            seen.add(line)
    return found


def reader_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test's environment without the virtualenv on PATH: activation must put it there."""
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != VENV_BIN]
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    return {**env, "PATH": os.pathsep.join(path), "PYTHONPATH": str(ROOT), **(extra or {})}


def reader_shell(folder: Path, env: dict[str, str], swaps: dict[str, str] | None = None):
    """Runs one guide line after the activation line, in `folder`; returns its stdout."""
    activate = ACTIVATE.replace(".venv/bin", str(VENV_BIN))

    def run(line: str, timeout: float = 300) -> str:
        for old, new in (swaps or {}).items():
            line = line.replace(old, new)
        done = subprocess.run(["bash", "-c", f"{activate} && {line}"], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    return run


def reader_folder(folder: Path) -> Path:
    """A folder holding `examples/` as the clone's, so nothing is written into the clone."""
    (folder / "examples").symlink_to(ROOT / "examples")
    return folder
