"""docs/decisions.md holds decisions only, each one re-runnable from a clean checkout.

The file's convention (its intro says the same): every entry is a `## ` heading followed by
bullets; one bullet starts `- Choice`, one starts `- Reason`, and one starts `- Command:` (the
command that re-runs the measurement) or `- Re-measure:` (the closest command, where the
original probe was not kept). Other bullets (`- Rejected:`) are free. Probes under the ignored
scratch folder are not in a checkout, so the file never points at one; the benchmark scripts it
names are tracked under benchmarks/, and CI imports each of them (test below) so they keep
importing against the current package.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DECISIONS = ROOT / "docs" / "decisions.md"
MAX_LINES = 400
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))

# A citation of an entry: the file name, then the heading (or its start) in double quotes; the
# quote may wrap onto the next comment or docstring line.
CITATION = re.compile(r"decisions\.md[,\s]*\"([^\"]+)\"")


def _text() -> str:
    return DECISIONS.read_text(encoding="utf-8")


def _entries() -> dict[str, list[str]]:
    """Heading -> the entry's lines (headings without the leading '## ')."""
    entries: dict[str, list[str]] = {}
    current = None
    in_code = False
    for line in _text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        if line.startswith("## "):
            current = line[3:].strip()
            assert current not in entries, f"two entries are headed {current!r}"
            entries[current] = []
        elif current is not None:
            entries[current].append(line)
    return entries


def test_decisions_is_short() -> None:
    n = len(_text().splitlines())
    assert n < MAX_LINES, f"docs/decisions.md has {n} lines; keep it under {MAX_LINES}"


def test_every_entry_has_choice_reason_and_command() -> None:
    entries = _entries()
    assert entries, "docs/decisions.md has no '## ' entries"
    for heading, lines in entries.items():
        bullets = [ln for ln in lines if ln.startswith("- ")]
        assert any(b.startswith("- Choice") for b in bullets), f"{heading!r}: no '- Choice' line"
        assert any(b.startswith("- Reason") for b in bullets), f"{heading!r}: no '- Reason' line"
        commands = [b for b in bullets if b.startswith(("- Command:", "- Re-measure"))]
        assert commands, f"{heading!r}: no '- Command:' or '- Re-measure' line"
        # The command bullet (with its wrapped continuation) names at least one command in
        # backticks.
        start = lines.index(commands[0])
        block = [lines[start]]
        for ln in lines[start + 1:]:
            if not ln.startswith("  "):
                break
            block.append(ln)
        assert "`" in " ".join(block), f"{heading!r}: its command line names no `command`"


def test_no_command_runs_a_scratch_probe() -> None:
    bad = [(i, ln) for i, ln in enumerate(_text().splitlines(), 1) if "scratch/" in ln]
    assert not bad, f"docs/decisions.md points at untracked scratch/ probes: {bad}"


def test_named_benchmark_scripts_exist() -> None:
    named = set(re.findall(r"benchmarks/[\w./-]+?\.py", _text()))
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"docs/decisions.md names benchmark scripts that are not tracked: {missing}"


def _citations() -> list[tuple[str, str]]:
    """(file, quoted heading) for each citation of an entry by heading in the code and docs."""
    found = []
    files = [*(ROOT / "kiln").rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
             *(ROOT / "examples").rglob("*.py"), ROOT / "README.md"]
    for path in files:
        if not path.is_file() or path == Path(__file__).resolve():
            continue
        for quoted in CITATION.findall(path.read_text(encoding="utf-8")):
            # Join a quote wrapped over comment or docstring lines.
            heading = re.sub(r"\s*\n\s*(#\s*)?", " ", quoted).strip()
            found.append((str(path.relative_to(ROOT)), heading))
    return found


def test_cited_headings_exist() -> None:
    headings = list(_entries())
    missing = [(f, h) for f, h in _citations() if not any(x.startswith(h) for x in headings)]
    assert not missing, ("citations of docs/decisions.md quote headings it no longer has "
                         f"(a heading must start with the quoted text): {missing}")


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.name for p in BENCHMARKS])
def test_benchmark_script_imports(path: Path) -> None:
    """Each tracked benchmark imports (its main runs only under `python benchmarks/X.py`)."""
    spec = importlib.util.spec_from_file_location(f"kiln_benchmarks_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
