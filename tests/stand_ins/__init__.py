"""Stand-ins for what this machine may lack (a GPU), for tests and dry runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
# Under its own name in-process, so that ``import cupy`` elsewhere still finds no CuPy.
_NAME = "cupy_stand_in"


def cupy_stand_in() -> ModuleType:
    """The CuPy stand-in (``stand_ins/cupy``), imported once, as ``cupy_stand_in``.
    Subprocesses get it as ``cupy`` with ``PYTHONPATH`` set to ``HERE``."""
    module = sys.modules.get(_NAME)
    if module is not None:
        return module
    folder = HERE / "cupy"
    spec = importlib.util.spec_from_file_location(
        _NAME, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    spec.loader.exec_module(module)
    return module
