"""Issue 24, item 1, as a property: any file of at most 16 MiB, mutated anywhere (bytes
flipped, integer fields — counts and lengths above all — set to extremes, cut short),
parses, indexes and plans within a time bound and under 256 MiB, or is refused with one
``GGUFError``. Run against every reference file (a split set as a set) and a synthetic
model. Memory is measured with ``tracemalloc`` (numpy reports its buffers to it)."""

from __future__ import annotations

import contextlib
import functools
import signal
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from conftest import REFERENCE_DIR, examples
from gguf_fields import IntField, integer_fields, set_field
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aiogguf._config import Config
from aiogguf.errors import GGUFError
from aiogguf.io._devices import CpuDevice, SimDevice
from aiogguf.stages.index import build_index
from aiogguf.stages.parse import parse_header
from aiogguf.stages.plan import make_plan
from aiogguf.testing.synth import write_synthetic_model

MAX_FILE_BYTES = 16 << 20
MEMORY_LIMIT_BYTES = 256 << 20
GiB = 1 << 30
SYNTHETIC = "<synthetic>"


def _sources() -> list[str]:
    """One entry per model: a single file, the first shard of a split set, or the
    synthetic model."""
    names = sorted(p.name for p in REFERENCE_DIR.glob("*.gguf"))
    return [n for n in names if "-split-" not in n or "-00001-of-" in n] + [SYNTHETIC]


@functools.cache
def _files(source: str) -> tuple[tuple[str, bytes], ...]:
    """The (name, bytes) of each file of ``source``, in split order."""
    if source == SYNTHETIC:
        folder = Path(__import__("tempfile").mkdtemp(prefix="aiogguf-bounds-"))
        model = write_synthetic_model(folder / "s.gguf", size_bytes="1MiB", seed=3, n_layer=3)
        return ((model.path.name, model.path.read_bytes()),)
    if "-split-" in source:
        prefix = source.split("-00001-of-")[0]
        paths = sorted(REFERENCE_DIR.glob(f"{prefix}-*-of-*.gguf"))
    else:
        paths = [REFERENCE_DIR / source]
    return tuple((p.name, p.read_bytes()) for p in paths)


@functools.cache
def _fields(source: str, k: int) -> tuple[IntField, ...]:
    # The version is left to tests/test_hostile.py: here, a wrong one would only stop
    # the parser at its fourth byte, over and over.
    return tuple(f for f in integer_fields(_files(source)[k][1]) if f.what != "version")


@functools.cache
def _counts(source: str, k: int) -> tuple[IntField, ...]:
    """The fields most likely to drive work: the record counts, array counts and the
    metadata's integer values (block_count, expert counts, split.count, ...)."""
    return tuple(
        f
        for f in _fields(source, k)
        if f.what in ("tensor_count", "kv_count")
        or f.what.endswith(" count")
        or (" " not in f.what and "[" not in f.what)
    )


def _extremes(field: IntField, old: int, file_size: int) -> list[int]:
    bits = 8 * field.size
    top = 1 << bits
    # The largest first: hypothesis favours the first items of a list.
    return [
        top - 1,
        top >> 1,
        2**31,
        2**32 - 1,
        2**63,
        (top >> 1) - 1,
        old * 1024,
        file_size,
        file_size - 1,
        old + 1,
        old - 1,
        1,
        0,
    ]


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, list[tuple[str, bytes]], list[str]]:
    """A source, its files with one of them mutated, and what was done (for failures)."""
    source = draw(st.sampled_from(_sources()))
    files = [list(f) for f in _files(source)]
    k = draw(st.integers(0, len(files) - 1))
    name, buf = files[k]
    fields = _fields(source, k)
    header_end = max((f.offset + f.size for f in fields), default=len(buf))
    done: list[str] = []
    # Mostly one change, so that most examples get past the parser to the index and
    # the plan; counts and lengths above all.
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        kind = draw(st.sampled_from(["count"] * 4 + ["field"] * 2 + ["byte"] * 3 + ["cut"]))
        counts = _counts(source, k)
        if kind in ("count", "field") and fields:
            field = draw(st.sampled_from(counts if kind == "count" and counts else fields))
            old = int.from_bytes(buf[field.offset : field.offset + field.size], "little")
            value = draw(st.sampled_from(_extremes(field, old, len(buf))))
            buf = set_field(buf, field, value)
            done.append(f"{field.what} @{field.offset} = {value}")
        elif kind == "byte" and buf:
            # Mostly in the header: data bytes change nothing parse, index or plan does.
            end = min(draw(st.sampled_from([header_end] * 3 + [len(buf)])), len(buf))
            # Past the magic and version, mostly (the same reason).
            start = min(draw(st.sampled_from([8, 8, 8, 0])), end - 1)
            at = draw(st.integers(max(start, 0), max(end - 1, 0)))
            flip = draw(st.integers(1, 255))
            buf = buf[:at] + bytes([buf[at] ^ flip]) + buf[at + 1 :]
            done.append(f"byte @{at} ^= {flip:#x}")
        else:
            at = len(buf) - draw(st.integers(0, len(buf)))  # mostly near the end
            buf = buf[:at]
            done.append(f"cut at {at}")
    files[k] = [name, buf]
    return source, [(n, b) for n, b in files], done


def _parse_index_plan(files: Sequence[tuple[str, bytes]]) -> None:
    parsed = tuple(parse_header(buf, name, len(buf)) for name, buf in files)
    index = build_index(parsed)
    devices = [
        CpuDevice(free=64 * GiB),
        SimDevice("g0", free=8 * GiB),
        SimDevice("g1", free=4 * GiB),
    ]
    make_plan(index, devices, Config().with_overrides(n_gpu_layers=-1))


class _Hung(Exception):
    pass


@contextlib.contextmanager
def _cpu_watchdog(limit_s: float) -> Iterator[None]:
    """Raise ``_Hung`` in the test's thread once the process has used ``limit_s`` of CPU
    time, so that a runaway loop fails the example (and hypothesis shrinks it) instead
    of running until pytest's timeout. CPU time (SIGVTALRM): pytest-timeout owns
    SIGALRM."""

    def hung(_signum: int, _frame: object) -> None:
        raise _Hung(f"still running after {limit_s} s of CPU time")

    previous = signal.signal(signal.SIGVTALRM, hung)
    signal.setitimer(signal.ITIMER_VIRTUAL, limit_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)


def _bounded(case: tuple[str, list[tuple[str, bytes]], list[str]], limit_s: float) -> None:
    source, files, done = case
    what = f"{source} after {done}"
    assert sum(len(b) for _, b in files) <= MAX_FILE_BYTES
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with _cpu_watchdog(2 * limit_s):
            _parse_index_plan(files)
    except GGUFError:
        pass  # refused: one error of the tree (anything else, a group included, fails)
    except _Hung as exc:
        pytest.fail(f"{what}: {exc}")
    finally:
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < MEMORY_LIMIT_BYTES, f"{what}: {peak / 2**20:.0f} MiB"
    assert elapsed < limit_s, f"{what}: {elapsed:.2f} s"


SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _finding_1() -> tuple[str, list[tuple[str, bytes]], list[str]]:
    """Issue 24's finding 1: tiny-llama-Q4_0 with ``llama.block_count`` = 2^31."""
    source = "tiny-llama-Q4_0.gguf"
    if not (REFERENCE_DIR / source).is_file():
        return source, [], []
    ((name, buf),) = _files(source)
    field = next(f for f in _fields(source, 0) if f.what == "llama.block_count")
    return source, [(name, set_field(buf, field, 2**31))], ["llama.block_count = 2^31"]


@settings(SETTINGS, max_examples=examples(default=200, ci=1200))
@example(case=_finding_1())
@given(case=mutated())
def test_mutated_files_parse_index_and_plan_within_bounds(
    reference_dir: Path, case: tuple[str, list[tuple[str, bytes]], list[str]]
) -> None:
    # A hang catcher in the default run (wall-clock bounds belong to the timing run).
    _bounded(case, limit_s=5.0)


@pytest.mark.timing
@settings(SETTINGS, max_examples=examples(default=100, ci=500))
@given(case=mutated())
def test_mutated_files_parse_index_and_plan_within_a_second(
    reference_dir: Path, case: tuple[str, list[tuple[str, bytes]], list[str]]
) -> None:
    _bounded(case, limit_s=1.0)


def test_the_mutations_reach_every_count_and_length(reference_dir: Path) -> None:
    """The strategy's fields include the counts and lengths of every kind of record."""
    whats = {f.what for f in _fields("tiny-llama-Q4_0.gguf", 0)}
    assert {"tensor_count", "kv_count", "llama.block_count"} <= whats
    assert "tokenizer.ggml.tokens count" in whats
    assert "tensor #0 n_dims" in whats
    assert "tensor #0 ne[0]" in whats
