"""``warm_up`` pays the collector's debt: the full collection that the objects of
``import aiogguf`` are owed runs there, not during a load, where it would hold the GIL
for tens of milliseconds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# A fresh process: after ``warm_up``, enough young collections that the collector's next
# automatic pass considers the old generation; it runs a full pass only if the objects
# made since the last full one are still owed one.
_DEBT = """
import gc, sys
import aiogguf
full = []
gc.callbacks.append(
    lambda phase, info: full.append(1) if phase == "stop" and info["generation"] == 2 else None
)
if sys.argv[1] == "warm":
    aiogguf.warm_up_sync()
full.clear()
for _ in range(gc.get_threshold()[2] + 1):
    gc.collect(1)
junk = [[] for _ in range(4 * gc.get_threshold()[0])]
print(len(full))
"""


@pytest.mark.parametrize(("warm", "full_passes"), [("warm", 0), ("cold", 0)])
def test_warm_up_pays_the_imports_collector_debt(
    tmp_path: Path, warm: str, full_passes: int
) -> None:
    """The full collection that ``import aiogguf``'s objects are owed does not fall, with
    the GIL held for tens of milliseconds, into a load: ``import aiogguf`` pays it, and
    ``warm_up`` too. Without that payment the cold process's collections brought a full
    pass (its first-use loop lag was 40-65 ms: ``test_first_use``)."""
    done = subprocess.run(
        [sys.executable, "-P", "-c", _DEBT, warm],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=True,
    )
    assert int(done.stdout.split()[-1]) == full_passes
