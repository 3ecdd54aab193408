"""A backstop, not a budget: no class in the package's pipeline/, stages/ or io/ grows past
``MAX_LINES`` lines, and no module past ``MAX_MODULE_LINES``. What keeps a module small is
that it does the one thing its name says; a class or module this long has stopped doing
so (the engine's ``_Load`` once merged validation paths, swapped bytes and assembled the
report). The limits are set well above today's sizes so that nobody moves a method just
to stay under them. The header parser is exempt: its length is the format's."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("pipeline", "stages", "io")
MAX_LINES = 400
MAX_MODULE_LINES = 1000
EXEMPT = {("stages/parse.py", "_HeaderParser")}


def _classes() -> list[tuple[str, str, int]]:
    found: list[tuple[str, str, int]] = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            where = path.relative_to(ROOT).as_posix()
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    assert node.end_lineno is not None
                    found.append((where, node.name, node.end_lineno - node.lineno + 1))
    return found


def test_the_walk_sees_the_engine_and_the_parser() -> None:
    names = {(where, name) for where, name, _ in _classes()}
    assert ("pipeline/_core/engine.py", "_Load") in names
    assert ("io/files.py", "DataFile") in names
    assert names >= EXEMPT, "an exempt class was renamed: update EXEMPT"


def test_no_class_is_over_the_limit() -> None:
    too_long = [
        f"{where}: class {name} is {lines} lines"
        for where, name, lines in _classes()
        if lines > MAX_LINES and (where, name) not in EXEMPT
    ]
    assert not too_long, f"over {MAX_LINES} lines: " + "; ".join(too_long)


def test_no_module_is_over_the_limit() -> None:
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*.py")
    }
    assert len(sizes) > 50  # the walk found the package
    too_long = [f"{where}: {n} lines" for where, n in sorted(sizes.items()) if n > MAX_MODULE_LINES]
    assert not too_long, f"over {MAX_MODULE_LINES} lines: " + "; ".join(too_long)
