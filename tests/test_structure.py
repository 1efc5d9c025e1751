"""The package's layout rules, read from its source (no import of mixgemm, no GPU).

* The top level of ``python/mixgemm`` holds only the package's face: ``__init__``, ``__main__``,
  the public dtypes, errors and the version; everything else lives in a subpackage.
* No module imports a private name (``_x``) from another subpackage.
* An import inside a function defers an optional or heavy dependency, and says so on its line.
* The library source, its shipped data and the README cite no session, notes file or experiment
  folder, and hold no absolute path of a build machine.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "python" / "mixgemm"
TOP_LEVEL = {"__init__.py", "__main__.py", "_version.py", "errors.py", "dtypes.py"}


def _modules():
    return sorted(PKG.rglob("*.py"))


def _subpackage(path: Path) -> str:
    parts = path.relative_to(PKG).parts
    return parts[0] if len(parts) > 1 else ""


def _imported_subpackage(path: Path, node: ast.ImportFrom) -> str:
    """The subpackage (first part below mixgemm) that ``node`` imports from, "" for the top level."""
    if node.level == 0:
        parts = (node.module or "").split(".")
        return parts[1] if parts[0] == "mixgemm" and len(parts) > 1 else ("" if parts[0] == "mixgemm" else "<other>")
    here = list(path.relative_to(PKG).parent.parts)
    base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
    parts = base + ((node.module or "").split(".") if node.module else [])
    return parts[0] if parts else ""


def test_the_top_level_holds_only_the_face():
    top = {p.name for p in PKG.glob("*.py")}
    assert top <= TOP_LEVEL, f"modules at the package's top level: {sorted(top - TOP_LEVEL)}"


def test_no_private_name_is_imported_across_subpackages():
    found = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _imported_subpackage(path, node)
            if target in ("<other>", _subpackage(path)):
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, "private names imported from another subpackage:\n" + "\n".join(found)


def test_every_import_inside_a_function_gives_its_reason():
    missing = []
    for path in _modules():
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and "#" not in lines[node.end_lineno - 1]:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not missing, "imports inside functions without a reason on their line:\n" + "\n".join(sorted(set(missing)))


LAB = re.compile(r"\bsession\s?\d+|\bsessions?/|NOTES\.md|NOTES §|benchmarks/experiments|/work/|/root/|/home/\w+",
                 re.IGNORECASE)


@pytest.mark.parametrize("where", ["python", "README.md", "cutlass_ext", "converters"])
def test_the_product_speaks_of_itself(where):
    base = ROOT / where
    paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()
                                                  and p.suffix in (".py", ".hpp", ".h", ".cpp", ".cu", ".json", ".md"))
    hits = []
    for path in paths:
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if LAB.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:120]}")
    assert not hits, "lab-notebook citations or machine paths:\n" + "\n".join(hits)
