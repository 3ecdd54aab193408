"""A CPU-only local load without a manifest, traced: run in a fresh interpreter
(``python -P core_closed_worker.py MODEL``). A profile function on every thread
(``sys.setprofile`` here, ``threading.setprofile`` for every thread started later, all
set before ``import aiogguf``) records the file of every Python function called, module
bodies included, so a module that is imported shows too. One JSON object on stdout: the
``aiogguf`` modules in ``sys.modules`` after the import and after the load, and the files
whose code ran, from the import on.
"""

from __future__ import annotations

import json
import sys
import threading
import warnings
from types import FrameType
from typing import Any

CALLED: set[str] = set()


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if event == "call":
        CALLED.add(frame.f_code.co_filename)


def _aiogguf_modules() -> list[str]:
    return sorted(m for m in sys.modules if m == "aiogguf" or m.startswith("aiogguf."))


def main(path: str) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    threading.setprofile(_profile)
    sys.setprofile(_profile)
    try:
        import aiogguf

        imported = _aiogguf_modules()
        with aiogguf.load_sync(path, mode="none", n_gpu_layers=0) as model:
            tensors = len(model.tensors)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return {
        "tensors": tensors,
        "imported": imported,
        "loaded": _aiogguf_modules(),
        "called": sorted(CALLED),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
