"""The guide is tested like code (issue 37): the site builds in MkDocs' strict mode (a broken
link or anchor, a page missing from the navigation, a docstring reference that does not
resolve: each is a warning, and strict mode makes it an error), and every code block of
README.md and of every page is classified and run, or skipped for a stated reason
(tests/guide_blocks.py). The blocks that train or need a service run in tests/test_readme.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from guide_blocks import (
    DOCS,
    LANGUAGES,
    LINE_KINDS,
    ROOT,
    blocks,
    code_blocks,
    kind_of,
    lines_of,
    nav_pages,
    reader_environment,
    reader_folder,
    reader_shell,
    shell_blocks,
)

README_MAX_LINES = 150
MARKDOWN_LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")
# Runs every block of a list in one interpreter (one torch import, not one per block), each
# in a namespace of its own, and names the first that fails.
RUN_BLOCKS = """
import json, sys, traceback
for label, code in json.load(sys.stdin):
    try:
        exec(compile(code, label, "exec"), {"__name__": "__main__"})
    except BaseException:
        print(f"guide block {label} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # Material's banner
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


def test_the_site_builds_strictly_with_every_page_and_the_generated_ones(site):
    for page in nav_pages():
        built = site / (page.removesuffix(".md").removesuffix("index") + "/index.html"
                        if page != "index.md" else "index.html")
        assert built.is_file(), page
    openapi = json.loads((site / "openapi.json").read_text())
    rest = (site / "rest-api" / "index.html").read_text()
    for path in openapi["paths"]:
        assert path in rest, f"{path} is missing from the REST API page"
    reference = (site / "reference" / "sparsity" / "index.html").read_text()
    assert 'id="sparsity.RigL"' in reference and 'id="sparsity.configure"' in reference


@pytest.mark.parametrize("package", ["sparsity", "sparsity.checkpoint", "sparsity.schedules",
                                     "simulator", "csx_config"])
def test_every_exported_class_and_function_has_a_docstring(package):
    """The reference shows documented members only, so an undocumented export would vanish
    from it."""
    import importlib
    import inspect

    module = importlib.import_module(package)
    exported = [getattr(module, name) for name in module.__all__]
    undocumented = [obj.__name__ for obj in exported
                    if (inspect.isclass(obj) and not obj.__dict__.get("__doc__"))
                    or ((inspect.isfunction(obj) or inspect.ismodule(obj)) and not obj.__doc__)]
    assert not undocumented, f"{package}: document {undocumented}"


def test_every_page_is_in_the_navigation():
    """MkDocs only warns about a page outside `nav` in some modes: a page in docs/ that no
    reader can reach from the navigation fails here."""
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == set(nav_pages())


def test_readme_is_short_and_its_links_resolve():
    """The README is not part of the site (GitHub shows it), so its links are checked here."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    targets = [target for target, _ in MARKDOWN_LINK.findall(readme) if "://" not in target]
    assert len(targets) >= 10
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_every_block_names_a_known_language():
    unknown = [(b.page, b.language or "(none)") for b in code_blocks() if b.language not in LANGUAGES]
    assert not unknown, f"give these blocks a language in guide_blocks.LANGUAGES: {unknown}"
    assert {b.language for b in code_blocks()} >= {"bash", "python", "yaml"}


def test_every_shell_line_is_classified():
    lines = [line for block in shell_blocks() for line in block]
    assert len(lines) >= 15
    unclassified = [line for line in lines if kind_of(line) is None]
    assert not unclassified, f"classify these guide commands in LINE_KINDS: {unclassified}"
    assert all(why for _, kind, why in LINE_KINDS if kind == "skip")  # says what covers it


def test_quick_lines_run_as_written(tmp_path):
    run = reader_shell(reader_folder(tmp_path), reader_environment())
    quick = lines_of("quick")
    assert any("--validate_only" in line for line in quick)
    for line in quick:
        out = run(line)
        if "--help" in line:
            assert out.startswith("usage: csx")
        if "--validate_only" in line:
            assert "FLOPs/token" in out and "speedup vs dense" in out
        if line.startswith("csx convert"):
            assert "trainer" in yaml.safe_load(out)


def test_python_blocks_run(tmp_path):
    python = [(f"{b.page}#{i}", b.text) for i, b in enumerate(blocks("python"))]
    assert len(python) >= 4
    done = subprocess.run([sys.executable, "-c", RUN_BLOCKS], input=json.dumps(python),
                          cwd=reader_folder(tmp_path), env=reader_environment(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_sparsity_yaml_blocks_configure():
    import sparsity

    sections = [yaml.safe_load(b.text) for b in blocks("yaml")]
    sections = [s["sparsity"] for s in sections if isinstance(s, dict) and "sparsity" in s]
    assert len(sections) >= 2  # both ModelZoo layouts
    for section in sections:
        assert sparsity.configure(section) is not None


def test_every_design_citation_in_the_tree_resolves_to_docs_design_md():
    """Code cites docs/design.md by section and the reference's quirks by number; each must
    name something that page holds, and nothing cites a design document outside the repo."""
    design = (DOCS / "design.md").read_text(encoding="utf-8")
    sections = set(re.findall(r"^## (\d+)\. ", design, flags=re.M))
    quirks_text = design.split("### Reference quirks", 1)[1].split("\n### ", 1)[0]
    quirks = set(re.findall(r"^(\d+)\. ", quirks_text, flags=re.M))
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.c", "*.md"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    cited_sections, cited_quirks, outside = set(), set(), []
    for name in tracked:
        if name.startswith("research/results/") or not (ROOT / name).is_file():
            continue
        text = (ROOT / name).read_text(encoding="utf-8", errors="replace")
        cited_sections |= {(name, n) for n in re.findall(r"docs/design\.md §(\d+)", text)}
        cited_quirks |= {(name, n) for n in re.findall(r"reference quirk (\d+)", text)}
        if re.search(r"DESIGN(\.md)? §|shared/DESIGN", text) and name != "tests/test_docs.py":
            outside.append(name)
    assert cited_sections and cited_quirks
    assert not outside, f"cite docs/design.md instead: {outside}"
    assert not {c for c in cited_sections if c[1] not in sections}
    assert not {c for c in cited_quirks if c[1] not in quirks}
