"""The shape of the house: how big the package is and how much of it one plain load touches.

Counts the package's modules and lines (pipeline/, stages/, io/), the modules left flat in
pipeline/, then loads a small synthetic model in a fresh process (CPU only, mode ``none``,
no manifest) with a profiler on every thread, and reports the ``aiogguf`` modules that load
imports, those whose code runs during it, the module→module call edges it takes, and
whether any code of a wing (``aiogguf.remote``, ``aiogguf.integrity``) ran. Not part of
the test run; tests/test_core_closed.py asserts what must hold.

    python bench/house.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("pipeline", "stages", "io")

# Run in a fresh interpreter: what it imports is the load's alone.
_PROBE = r"""
import json, sys, threading
from pathlib import Path

path, out = sys.argv[1], sys.argv[2]
import aiogguf
files = {}
edges = set()
ran = set()

def module_of(code):
    name = files.get(code.co_filename)
    if name is None:
        for mod in list(sys.modules.values()):
            f = getattr(mod, "__file__", None)
            if f and Path(f).resolve() == Path(code.co_filename).resolve():
                files[code.co_filename] = name = mod.__name__
                break
        else:
            files[code.co_filename] = name = ""
    return name

def profile(frame, event, arg):
    if event != "call":
        return
    callee = module_of(frame.f_code)
    if not callee.startswith("aiogguf"):
        return
    ran.add(callee)
    back = frame.f_back
    if back is not None:
        caller = module_of(back.f_code)
        if caller.startswith("aiogguf") and caller != callee:
            edges.add((caller, callee))

before = {m for m in sys.modules if m.startswith("aiogguf")}
threading.setprofile(profile)
sys.setprofile(profile)
with aiogguf.load_sync(path, mode="none") as model:
    assert model.tensors
sys.setprofile(None)
threading.setprofile(None)
after = {m for m in sys.modules if m.startswith("aiogguf")}
json.dump(
    {
        "imported": sorted(after),
        "imported_by_the_load": sorted(after - before),
        "ran": sorted(ran),
        "edges": sorted(edges),
    },
    open(out, "w"),
)
"""


def package_size() -> dict[str, int]:
    modules = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")]
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in modules)
    flat = [p for p in (ROOT / "pipeline").glob("*.py")]
    return {"modules": len(modules), "lines": lines, "flat_pipeline_modules": len(flat)}


def one_load() -> dict[str, list[str]]:
    from aiogguf.testing.synth import write_synthetic_model

    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "model.gguf"
        write_synthetic_model(model, size_bytes=8 << 20)
        out = Path(folder) / "probe.json"
        subprocess.run(
            [sys.executable, "-c", _PROBE, str(model), str(out)],
            check=True,
            timeout=120,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
        found: dict[str, list[str]] = json.loads(out.read_text())
        return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    size = package_size()
    load = one_load()
    wings = ("aiogguf.remote", "aiogguf.integrity")
    figures = {
        **size,
        "modules_imported_by_import_and_load": len(load["imported"]),
        "modules_whose_code_ran": len(load["ran"]),
        "module_call_edges": len(load["edges"]),
        "wing_modules_that_ran": [m for m in load["ran"] if m.startswith(wings)],
        "wing_modules_imported": [m for m in load["imported"] if m.startswith(wings)],
    }
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    for key, value in figures.items():
        print(f"{key:40} {value}")


if __name__ == "__main__":
    main()
