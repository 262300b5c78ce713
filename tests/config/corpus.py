"""The ModelZoo corpus (tests/fixtures/modelzoo_corpus/<family>/<layout>/<release>_<name>.yaml,
built by tools/modelzoo_corpus.py) and what the tests hold it to (expected.yaml there)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import yaml

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "modelzoo_corpus"
FILES = sorted(CORPUS.glob("*/*/*.yaml"))
EXPECTED = yaml.safe_load((CORPUS / "expected.yaml").read_text())


def family_layout(path: Path) -> tuple[str, str]:
    return path.parts[-3], path.parts[-2]


def check_outcomes(outcomes: dict[Path, str | None], how: str) -> None:
    """Print validated / refused per family x layout; assert the share validated, that exactly
    the files of the expected families are refused, and that each refusal is one line naming an
    unsupported feature (``outcomes``: file -> None or the refusal)."""
    table: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for path, refusal in outcomes.items():
        table[family_layout(path)][refusal is not None] += 1
    print(f"\nModelZoo corpus through {how}:\n  {'family':10s} {'layout':10s} files validated refused")
    for (family, layout), (ok, refused) in sorted(table.items()):
        print(f"  {family:10s} {layout:10s} {ok + refused:5d} {ok:9d} {refused:7d}")
    validated = sum(refusal is None for refusal in outcomes.values())
    print(f"  total {validated} / {len(outcomes)} validated")
    assert len(outcomes) == len(FILES) >= 500
    assert {family for family, _ in table} == set(EXPECTED["families"])
    assert validated / len(outcomes) >= EXPECTED["min_validated_share"]
    for path, refusal in outcomes.items():
        assert (refusal is not None) == (family_layout(path)[0] in EXPECTED["refused_families"]), (path, refusal)
        if refusal is None:
            continue
        problems = [line for line in refusal.splitlines() if line.startswith("  - ")]
        assert len(problems) == 1 and EXPECTED["refusal_must_say"] in problems[0], (path, refusal)  # one line
        assert "did you mean" not in refusal, (path, refusal)  # a published key is never a misspelling
