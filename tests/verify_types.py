"""``pyright --verifytypes aiogguf``: how completely the installed package's public names
are typed, as pyright (basedpyright, which brings its own Node.js) sees them.

Run as a script (``.ci/run`` runs it on the non-editable install) it exits 1 below the
score given (default 0.95) or above ``MAX_PUBLIC_MODULES`` public modules;
``tests/test_exports.py`` calls ``completeness``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MIN_SCORE = 0.95
# Modules pyright takes for public (no leading underscore on the way to them).
MAX_PUBLIC_MODULES = 50
REPOSITORY = Path(__file__).resolve().parent.parent


def pyright() -> str | None:
    """The basedpyright executable beside this interpreter, or on ``PATH``."""
    beside = Path(sys.executable).with_name("basedpyright")
    return str(beside) if beside.exists() else shutil.which("basedpyright")


def completeness(executable: str) -> dict[str, object]:
    """pyright's ``typeCompleteness`` report on ``aiogguf`` as this interpreter imports
    it (``PYTHONPATH`` included), run from an empty folder so that the repository's own
    folders are not taken for the package. This interpreter's folder comes first on
    ``PATH``: pyright asks the first ``python`` there for the search paths (``--verifytypes``
    takes no ``--pythonpath``), and outside an activated venv that one has no anyio or
    numpy, whose types would then count as unknown."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    with tempfile.TemporaryDirectory() as empty:
        result = subprocess.run(
            [executable, "--verifytypes", "aiogguf", "--ignoreexternal", "--outputjson"],
            cwd=empty,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    report: dict[str, object] = json.loads(result.stdout)["typeCompleteness"]
    return report


def unresolved_imports(executable: str, root: Path) -> list[str]:
    """``file:line: message`` of each import pyright cannot resolve in ``root``."""
    result = subprocess.run(
        [executable, "--outputjson", str(root)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    found: list[str] = []
    for diagnostic in json.loads(result.stdout)["generalDiagnostics"]:
        if diagnostic.get("rule") in ("reportMissingImports", "reportMissingModuleSource"):
            where = Path(diagnostic["file"]).relative_to(root)
            line = diagnostic["range"]["start"]["line"] + 1
            found.append(f"{where}:{line}: {diagnostic['message']}")
    return found


def main() -> int:
    minimum = float(sys.argv[1]) if len(sys.argv) > 1 else MIN_SCORE
    executable = pyright()
    if executable is None:
        print("basedpyright is not installed (pip install -e '.[dev]')", file=sys.stderr)
        return 1
    report = completeness(executable)
    score = float(report["completenessScore"])  # type: ignore[arg-type]
    modules = sorted(str(m["name"]) for m in report["modules"])  # type: ignore[attr-defined]
    print(
        f"{report['packageRootDirectory']}: type completeness {score:.1%} (minimum {minimum:.0%}),"
        f" {len(modules)} public modules (at most {MAX_PUBLIC_MODULES})"
    )
    if len(modules) > MAX_PUBLIC_MODULES:
        print("public modules: " + ", ".join(modules), file=sys.stderr)
        return 1
    return 0 if score >= minimum else 1


if __name__ == "__main__":
    sys.exit(main())
