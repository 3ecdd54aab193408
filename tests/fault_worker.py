"""Runs truncation trials in a process of its own: a file cut under a load must end the
load in one ``LoadError``, not end the process (a SIGBUS would kill it, and the parent
sees the signal in the exit status).

Usage: ``python fault_worker.py MODES SOURCE WORKDIR SEED...`` (MODES: one mode or a
comma list; one process runs them all, as starting an interpreter costs more than a
trial). For each mode and seed: copy SOURCE, load the copy in the mode with every check
on, and truncate it to a random length just before a random one of the load's read calls
(``fault_helpers.READ_CALLS``). One JSON line per trial on stdout: the mode, the seed,
the outcome, the error's type, path, offset and message, and anything the failed load
left behind.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import warnings
from pathlib import Path
from typing import Any

from fault_helpers import CallSeam, copy_file, holdings

import aiogguf

# Small jobs: many read calls per load, so a cut lands between reads and checks.
CHUNK = "64KiB"


def load(path: Path, mode: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a refused mlock or O_DIRECT: not the point here
        with aiogguf.load_sync(path, mode=mode, chunk_size=CHUNK, check_tensors=True):
            pass


def trial(mode: str, source: Path, workdir: Path, seed: int, calls: int) -> dict[str, Any]:
    rng = random.Random(seed)
    path = workdir / f"trial-{mode}-{seed}.gguf"
    copy_file(source, path)
    size = path.stat().st_size
    cut = rng.randrange(0, size)
    at = rng.randint(1, calls)
    inodes = {path.stat().st_ino}
    before = holdings(inodes)
    seam = CallSeam(lambda: os.truncate(path, cut), at)
    result: dict[str, Any] = {"mode": mode, "seed": seed, "cut": cut, "at": at}
    try:
        with seam.installed():
            load(path, mode)
        result["outcome"] = "loaded"
    except aiogguf.GGUFError as exc:
        result.update(
            outcome=type(exc).__name__,
            path=getattr(exc, "path", None),
            offset=getattr(exc, "offset", None),
            message=str(exc),
            notes=list(getattr(exc, "__notes__", [])),
        )
    except Exception as exc:  # reported to the parent, which fails the test
        result.update(outcome=type(exc).__name__, message=str(exc))
    result["fired"] = seam.fired
    result["expected_path"] = str(path)
    result["leaks"] = holdings(inodes).leaks(before)
    path.unlink()
    return result


def main(argv: list[str]) -> None:
    modes, source, workdir = argv[0].split(","), Path(argv[1]), Path(argv[2])
    for mode in modes:
        # A clean load first: how many read calls a load of this file makes in this mode.
        counter = CallSeam(lambda: None, 0)
        clean = workdir / f"clean-{mode}-{os.getpid()}.gguf"
        copy_file(source, clean)
        with counter.installed():
            load(clean, mode)
        clean.unlink()
        # What the imports and the clean load built stays: a failed load's full garbage
        # collection need not scan it on every trial.
        gc.collect()
        gc.freeze()
        for seed in (int(s) for s in argv[3:]):
            print(json.dumps(trial(mode, source, workdir, seed, counter.count)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
