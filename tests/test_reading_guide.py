"""docs/reading-guide.md stays true: every ``path.py: name`` it cites names a module of
the repository that defines that function or class (and method, for ``Class.method``),
and every path it cites exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "reading-guide.md"
CITED = re.compile(r"`((?:pipeline|stages|io|tests|docs)/[\w/.-]+?): ([\w.]+)`")
PATH = re.compile(r"`((?:pipeline|stages|io|tests|docs)/[\w/.-]+\.(?:py|md))`")


def _defined(path: Path) -> dict[str, set[str]]:
    """Top-level names of a module, each with the methods it defines (classes)."""
    names: dict[str, set[str]] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            names[node.name] = {
                n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    return names


def test_the_guide_cites_code_that_exists() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    cited = CITED.findall(text)
    assert len(cited) > 15  # the walk found the guide's citations
    wrong: list[str] = []
    for where, name in cited:
        path = ROOT / where
        if not path.is_file():
            wrong.append(f"{where}: no such file")
            continue
        top, _, method = name.partition(".")
        names = _defined(path)
        if top not in names or (method and method not in names[top]):
            wrong.append(f"{where}: {name} is not defined there")
    assert wrong == []


def test_the_guide_cites_paths_that_exist() -> None:
    paths = PATH.findall(GUIDE.read_text(encoding="utf-8"))
    assert paths
    assert [p for p in paths if not (ROOT / p).is_file()] == []


def test_the_guide_cites_methods_that_exist() -> None:
    """``Class.method`` cited without a path: some module of the package defines it."""
    methods = set(re.findall(r"`(_?[A-Z]\w*)\.(\w+)`", GUIDE.read_text(encoding="utf-8")))
    assert len(methods) > 10
    classes: dict[str, set[str]] = {}
    for folder in ("pipeline", "stages", "io"):
        for path in (ROOT / folder).rglob("*.py"):
            for name, members in _defined(path).items():
                classes.setdefault(name, set()).update(members)
    assert sorted(f"{c}.{m}" for c, m in methods if m not in classes.get(c, set())) == []
