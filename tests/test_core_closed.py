"""The load core is closed to its wings: a CPU-only local load without a manifest runs
no code of ``aiogguf.remote`` or ``aiogguf.integrity`` (not even their modules' bodies:
they are not imported) and imports at most 50 modules of the package; the front joins
few modules, and the reader takes few parameters and never asks which kind of source it
reads (issue 36)."""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import aiogguf
from aiogguf.stages.read import Reader
from aiogguf.testing.synth import write_synthetic_model

WORKER = Path(__file__).with_name("core_closed_worker.py")
PACKAGE = Path(aiogguf.__file__).resolve().parent
CORE = Path(__file__).resolve().parent.parent / "pipeline" / "_core"
MAX_MODULES = 50


def _wing_files(called: list[str]) -> list[str]:
    """The files of ``called`` in the remote or integrity wing (by the installed package's
    folders: an editable install links each file, so both its paths are looked at)."""
    wings = ("remote", "integrity")
    return [
        f
        for f in called
        if any(f"{os.sep}aiogguf{os.sep}{w}{os.sep}" in f for w in wings)
        or any(f.startswith(str(PACKAGE / w)) for w in wings)
    ]


def test_a_local_load_runs_no_wing_code_and_imports_few_modules(tmp_path: Path) -> None:
    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes="2MiB", seed=3, n_layer=2)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    # -P and a neutral folder: the repository root holds a folder named io.
    proc = subprocess.run(
        [sys.executable, "-P", str(WORKER), str(model.path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout)
    assert found["tensors"] == len(model.tensors)
    # The trace saw the load: its stages ran, on its threads too.
    assert any(f.endswith(f"stages{os.sep}read.py") for f in found["called"])
    assert any(f.endswith(f"_core{os.sep}assemble.py") for f in found["called"])
    assert _wing_files(found["called"]) == []
    wings = [m for m in found["loaded"] if m.startswith(("aiogguf.remote", "aiogguf.integrity"))]
    assert wings == []
    assert len(found["loaded"]) <= MAX_MODULES, found["loaded"]


def test_the_trace_sees_wing_code_where_it_runs() -> None:
    """The filter above is not blind: a wing's file is recognised by its path."""
    import aiogguf.integrity._sink as sink

    assert _wing_files([sink.__file__, aiogguf.__file__]) == [sink.__file__]


def _package_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aiogguf"):
            found.add(node.module or "")
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("aiogguf"))
    return found


def test_the_front_joins_at_most_ten_modules() -> None:
    imports = _package_imports(CORE / "front.py")
    assert 3 <= len(imports) <= 10, sorted(imports)


def test_the_reader_takes_at_most_six_parameters() -> None:
    parameters = [p for p in inspect.signature(Reader).parameters if p != "self"]
    assert len(parameters) <= 6, parameters


def test_no_core_module_asks_which_kind_of_source_it_has() -> None:
    """No ``isinstance`` on a source kind, no ``self.remote`` asked: a source says what
    the core needs (``ByteSource``)."""
    kinds = {"DataFile", "HttpSource", "HubSource"}
    asked: list[str] = []
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and len(node.args) == 2
            ):
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                asked += [f"{path.name}:{node.lineno} isinstance {k}" for k in names & kinds]
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "remote"
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                asked.append(f"{path.name}:{node.lineno} self.remote")
    assert len(list(CORE.glob("*.py"))) >= 5
    assert asked == []
