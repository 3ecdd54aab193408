"""gguf-py's own scripts (``gguf/scripts/``, shipped in the ``gguf`` package) print and
write the same with ``aiogguf.compat._reader.GGUFReader`` in place of gguf-py's reader.

Every reference file, a synthetic file of every type and a big-endian one go through
``gguf_dump.py`` in each output format, ``gguf_hash.py``, ``gguf_convert_endian.py
--dry-run`` to each byte order, ``gguf_set_metadata.py --dry-run`` on a field of each
value type the file has (to its own value and to another) and on a missing key, and
``gguf_new_metadata.py`` (a plain copy and one with new metadata): stdout, the scripts'
log lines, the exit status, any exception, and the file written must be the same with
both readers. The runs are in-process (``tests/gguf_scripts.py``); gguf-py's reader is
made once per file and handed to every run (none of these runs changes it), ours is
made afresh for each. A few whole processes check the swap as a user would do it.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import reference_files

gguf = pytest.importorskip("gguf")
from gguf_scripts import Outcome, run_script  # noqa: E402 - needs gguf, as the skip says
from helpers_gguf import write_gguf  # noqa: E402

from aiogguf.compat._reader import GGUFReader  # noqa: E402
from aiogguf.testing.synth import write_synthetic_model  # noqa: E402

HERE = Path(__file__).resolve().parent
# gguf_dump.py's outputs: console (with and without tensors), JSON (with arrays, without
# tensors), markdown, the data offset, the alignment.
DUMPS = [
    [],
    ["--no-tensors"],
    ["--json"],
    ["--json", "--json-array"],
    ["--json", "--no-tensors"],
    ["--markdown"],
    ["--markdown", "--no-tensors"],
    ["--data-offset"],
    ["--data-alignment"],
]
# gguf_new_metadata.py: a copy, and one that sets, replaces and removes metadata.
NEW_METADATA = [
    ["--force"],
    [
        *("--force", "--general-name", "compat", "--general-description", "two readers"),
        *("--chat-template", "{{ messages }}", "--pre-tokenizer", "default"),
        *("--special-token-by-id", "bos", "1", "--remove-metadata", "general.file_type"),
    ],
]


def script_runs(oracle: Any) -> list[tuple[str, list[str]]]:
    """(script, arguments after the file) for a file that gguf-py reads as ``oracle``."""
    runs = [("gguf_dump", args) for args in DUMPS]
    runs += [("gguf_hash", []), ("gguf_hash", ["--no-layer"])]
    runs += [("gguf_convert_endian", [order, "--dry-run"]) for order in ("big", "little")]
    runs += [("gguf_convert_endian", ["native", "--dry-run"])]
    # One field of each value type (GGUF.version is the first UINT32): to its own value
    # ("already set"), to another (a string or an array: refused).
    seen: set[tuple[Any, ...]] = set()
    for name, field in oracle.fields.items():
        if tuple(field.types) in seen:
            continue
        seen.add(tuple(field.types))
        value = str(field.contents()) if field.types[0] in oracle.gguf_scalar_to_np else "x"
        runs += [("gguf_set_metadata", [name, value, "--dry-run"])]
        runs += [("gguf_set_metadata", [name, "2", "--dry-run"])]
    runs += [("gguf_set_metadata", ["no.such.key", "1", "--dry-run"])]
    return runs


def differences(path: Path, out_dir: Path) -> list[str]:
    """Every run of every script on ``path`` with both readers; what differed."""
    oracle = functools.cache(gguf.gguf_reader.GGUFReader)
    found: list[str] = []
    ran = 0

    def both(script: str, argv: list[str], written: Path | None = None) -> None:
        nonlocal ran
        outcomes: list[tuple[Outcome, bytes | None]] = []
        for reader in (oracle, GGUFReader):
            outcome = run_script(reader, script, argv)
            data = written.read_bytes() if written is not None and written.exists() else None
            if written is not None:
                written.unlink(missing_ok=True)
            outcomes.append((outcome, data))
        (theirs, their_file), (ours, our_file) = outcomes
        ran += 1
        for what in ("exit_code", "error", "stdout", "log"):
            a, b = getattr(theirs, what), getattr(ours, what)
            if a != b:
                found.append(f"{script} {' '.join(argv[1:])}: {what}: {_first_change(a, b)}")
        if their_file != our_file:
            found.append(f"{script} {' '.join(argv[1:])}: the files written differ")
        # Two readers failing alike would agree: these runs must work with gguf-py's.
        works = script in ("gguf_dump", "gguf_hash") or argv[3:] == ["--force"]
        failed = theirs.error or theirs.exit_code or (written and their_file is None)
        if works and failed:
            found.append(f"{script} {' '.join(argv[1:])}: gguf-py's run failed: {failed}")

    for script, args in script_runs(oracle(str(path), "r")):
        both(script, [str(path), *args])
    written = out_dir / "new.gguf"
    for args in NEW_METADATA:
        both("gguf_new_metadata", [str(path), str(written), *args], written)
    assert ran >= len(DUMPS) + 10
    return found


def _first_change(theirs: Any, ours: Any) -> str:
    if not isinstance(theirs, str) or not isinstance(ours, str):
        return f"gguf-py {theirs!r}, aiogguf {ours!r}"
    for n, (a, b) in enumerate(zip(theirs.splitlines(), ours.splitlines(), strict=False)):
        if a != b:
            return f"line {n + 1}: gguf-py {a[:200]!r}, aiogguf {b[:200]!r}"
    return f"gguf-py {len(theirs)} characters, aiogguf {len(ours)}"


# One of each kind in the default run: floats, a K-quant, an IQ, a ternary type, BF16
# embeddings, a middle shard; the rest (and the vocabulary-only file, the slowest: 10^5
# strings for each reader) with the slow tests.
DEFAULT_RUN = {
    "tiny-llama-F16.gguf",
    "tiny-llama-Q4_K_M.gguf",
    "tiny-llama-IQ1_M.gguf",
    "tiny-llama-TQ1_0.gguf",
    "tiny-llama-Q5_1-bf16emb.gguf",
    "tiny-llama-Q4_K_M-split-00002-of-00003.gguf",
}


@pytest.mark.parametrize(
    "name",
    [
        name
        if name in DEFAULT_RUN or name == "<missing>"
        else pytest.param(name, marks=pytest.mark.slow)
        for name in reference_files()
    ],
)
def test_reference_files(name: str, reference_dir: Path, tmp_path: Path) -> None:
    found = differences(reference_dir / name, tmp_path)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("big_endian", [False, True], ids=["every-type", "big-endian"])
def test_synthetic_files(big_endian: bool, tmp_path: Path) -> None:
    """Every type gguf 0.19 reads (gguf_convert_endian refuses most of them, with the
    same error), and a big-endian file, whose tensors gguf-py hands over as the file's
    bytes (gguf_hash.py hashes them, gguf_new_metadata.py writes them out as they are)."""
    types = "float" if big_endian else "all-types"
    model = write_synthetic_model(
        tmp_path / "m.gguf",
        size_bytes="1MiB",
        seed=5,
        types=types,
        big_endian=big_endian,
        include_q2_0=False,
    )
    found = differences(model.path, tmp_path)
    assert not found, "\n".join(found)


def test_the_scripts_do_their_work(tmp_path: Path) -> None:
    """The comparison compares real output: on a file of known content each script
    prints what the file holds, with our reader."""
    weights = np.arange(64, dtype=np.float32).reshape(2, 32)
    kv = {"general.architecture": "llama", "llama.block_count": np.uint32(3)}
    path = write_gguf(tmp_path / "t.gguf", kv, [("a.weight", weights)])
    dump = run_script(GGUFReader, "gguf_dump", [str(path)])
    assert (dump.exit_code, dump.error) == (None, None)
    assert "UINT32     |        1 | llama.block_count = 3" in dump.stdout
    assert "   64 |    32,     2,     1,     1 | F32     | a.weight" in dump.stdout
    assert f"INFO:gguf-dump:* Loading: {path}" in dump.log
    hashed = run_script(GGUFReader, "gguf_hash", [str(path), "--no-layer"])
    sha256 = hashlib.sha256(weights.tobytes()).hexdigest()
    assert f"sha256    {sha256}  {path}" in hashed.stdout
    same = run_script(
        GGUFReader, "gguf_set_metadata", [str(path), "llama.block_count", "3", "--dry-run"]
    )
    assert same.exit_code == 0
    assert "already set to requested value 3" in same.log
    other = run_script(
        GGUFReader, "gguf_set_metadata", [str(path), "llama.block_count", "4", "--dry-run"]
    )
    assert other.exit_code == 0
    assert "from 3 to 4" in other.log
    refused = run_script(
        GGUFReader, "gguf_set_metadata", [str(path), "general.architecture", "x", "--dry-run"]
    )
    assert refused.exit_code == 1
    assert "only supports changing simple values" in refused.log


# A whole process each: the script's own __main__, its logging.basicConfig, its exit.
# (script, arguments, whether it logs "* Loading" to stderr, its exit status)
PROCESS_RUNS = [
    ("gguf_dump", [], True),
    ("gguf_dump", ["--markdown"], False),
    ("gguf_set_metadata", ["llama.block_count", "7", "--dry-run"], True),
]


@pytest.mark.parametrize(("script", "args", "logs"), PROCESS_RUNS)
def test_as_processes(script: str, args: list[str], logs: bool, reference_dir: Path) -> None:
    path = reference_dir / "tiny-llama-Q4_K_M.gguf"
    results = []
    for reader in ("gguf-py", "aiogguf"):
        command = [sys.executable, str(HERE / "gguf_scripts.py"), reader, script, str(path)]
        done = subprocess.run(command + args, capture_output=True, text=True, timeout=60)
        results.append((done.returncode, done.stdout, done.stderr))
    assert results[0] == results[1]
    returncode, stdout, stderr = results[1]
    assert returncode == 0
    assert (f"INFO:{script.replace('_', '-')}:* Loading: {path}\n" in stderr) == logs
    assert bool(stdout) == (script == "gguf_dump")
