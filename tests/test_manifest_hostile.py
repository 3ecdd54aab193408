"""Hostile manifests cost bounded time and memory, and a manifest a load cannot use is
refused by the load, not passed.

- llama-gguf-hash keys of many colons are matched in time linear in the key (a key of
  n colons cost n^2 / 2 character compares), a key longer than any path and tensor
  name is refused at once, and a load cancelled while its manifest is matched ends
  within a second or two;
- a llama manifest of whole-model lines only (no tensor line) is refused by ``load``
  and ``validate`` naming ``aiogguf verify``, which checks it;
- a 32 MiB manifest of any shape peaks under 300 MB in the process that reads it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import gguf
import pytest

import aiogguf
from aiogguf.cli import main
from aiogguf.errors import IntegrityError, ManifestError, ManifestMismatchError
from aiogguf.integrity._hashing import hash_model_llama_sync, verify_model_sync
from aiogguf.integrity._llama_hash import format_llama, match_llama, parse_llama
from aiogguf.integrity._manifest import (
    MAX_MANIFEST_BYTES,
    FileHashes,
    Manifest,
    TensorHash,
    compute_set_id,
    manifest_json,
    parse_manifest,
)
from aiogguf.io.workers import StopLink, Stopped
from aiogguf.testing.synth import write_synthetic_model

MiB = 1 << 20
# Keys of 30,000 colons (within the longest key read): 168 of them took the old matcher
# about 20 s (a key of n colons, n^2 / 2 compares), twice that in verify; the linear
# one takes milliseconds.
COLONS = 30_000
REPEAT = 8  # lines a tensor: the most a manifest of a model may have
PEAK_LIMIT_MB = 300


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "m.gguf"
    write_synthetic_model(path, size_bytes="2MiB", seed=8, n_layer=2)
    return path


def llama_lines(model: Path) -> list[tuple[str, str, str]]:
    """(algorithm, digest, key) of every line ``aiogguf hash --format llama`` writes."""
    text = format_llama(hash_model_llama_sync(model))
    return [(a, d, k) for a, d, k in (line.split() for line in text.splitlines())]


@pytest.fixture(scope="module")
def lines(model: Path) -> list[tuple[str, str, str]]:
    return llama_lines(model)


def tensor_lines(lines: list[tuple[str, str, str]], prefix: str, algorithm: str) -> list[str]:
    return [
        f"{a:<8}  {d}  {prefix}{k.split(':', 1)[1]}"
        for a, d, k in lines
        if ":" in k and a == algorithm
    ]


def colon_manifest(lines: list[tuple[str, str, str]], colons: int, repeat: int) -> str:
    """Every tensor's xxh64 line ``repeat`` times, keyed by ``colons`` colons and the
    tensor's name: valid keys (the file part is ignored), each the worst case of the
    longest-suffix search."""
    return "\n".join(tensor_lines(lines, ":" * colons, "xxh64") * repeat) + "\n"


def within(seconds: float, call: Callable[[], object]) -> None:
    started = time.perf_counter()
    call()
    elapsed = time.perf_counter() - started
    assert elapsed < seconds


# --- matching is linear ------------------------------------------------------------------


def test_keys_of_many_colons_are_matched_in_linear_time(
    model: Path, lines: list[tuple[str, str, str]]
) -> None:
    text = colon_manifest(lines, COLONS, REPEAT)
    within(5, lambda: verify_model_sync(model, parse_llama(text, "h.txt")))


def test_a_key_of_360000_colons_is_refused_at_once(
    model: Path, lines: list[tuple[str, str, str]]
) -> None:
    text = colon_manifest(lines, 360_000, repeat=1)

    def refused() -> None:
        with pytest.raises(ManifestError, match=r"h\.txt: line 1: a key of 360\d+ characters"):
            verify_model_sync(model, parse_llama(text, "h.txt"))

    within(5, refused)


@pytest.mark.timing
def test_a_32_mib_manifest_of_colon_keys_is_matched_in_about_a_second(tmp_path: Path) -> None:
    path = tmp_path / "big.gguf"
    write_synthetic_model(path, size_bytes="4MiB", seed=2, n_layer=16)
    keyed = tensor_lines(llama_lines(path), ":" * COLONS, "xxh64")
    text = "\n".join(keyed * (MAX_MANIFEST_BYTES // len("\n".join(keyed)))) + "\n"
    assert MAX_MANIFEST_BYTES - 4 * MiB < len(text) <= MAX_MANIFEST_BYTES
    manifest = tmp_path / "big.txt"
    manifest.write_text(text)
    tensors = len(gguf.GGUFReader(path).tensors)

    def load() -> None:
        with aiogguf.load_sync(path, manifest=str(manifest), mode="none") as loaded:
            assert loaded.report.tensors_hashed == tensors

    within(1.5, load)  # the old matcher: 2 min (1,100 keys of 30,000 colons)


def test_a_manifest_with_more_lines_than_the_model_could_have_is_refused(
    model: Path, lines: list[tuple[str, str, str]]
) -> None:
    text = colon_manifest(lines, 10, repeat=9)  # 9 lines a tensor: 8 is the most
    with pytest.raises(ManifestMismatchError, match="more than 178 hash lines"):
        verify_model_sync(model, parse_llama(text, "h.txt"))


def test_matching_looks_at_the_loads_stop(model: Path, lines: list[tuple[str, str, str]]) -> None:
    manifest = parse_llama(colon_manifest(lines, 10, repeat=1))
    names = {t.name: "m.gguf" for t in gguf.GGUFReader(model).tensors}
    assert len(list(match_llama(manifest, names, ["m.gguf"]))) == len(names)
    with pytest.raises(Stopped):
        StopLink(lambda: True).run(lambda: list(match_llama(manifest, names, ["m.gguf"])))


def test_reading_a_json_manifest_looks_at_the_loads_stop() -> None:
    text = _valid_json(5000)
    assert len(parse_manifest(text).tensors) == 5000
    with pytest.raises(Stopped):
        StopLink(lambda: True).run(lambda: parse_manifest(text))


def test_a_cancelled_load_with_a_hostile_manifest_ends_promptly(
    model: Path, lines: list[tuple[str, str, str]], tmp_path: Path
) -> None:
    manifest = tmp_path / "h.txt"
    manifest.write_text(colon_manifest(lines, COLONS, REPEAT))

    async def cancelled() -> float:
        with anyio.move_on_after(0.3) as scope:
            async with aiogguf.load(model, manifest=str(manifest), mode="none"):
                await anyio.sleep(30)
        assert scope.cancelled_caught
        return time.perf_counter()

    started = time.perf_counter()
    ended = anyio.run(cancelled)
    assert ended - started < 3  # the old matcher held the load's thread for ~20 s


# --- whole-model lines only ----------------------------------------------------------------


@pytest.fixture
def whole_model(model: Path, lines: list[tuple[str, str, str]], tmp_path: Path) -> Path:
    """The model's whole-model lines only, the sha256 one wrong."""
    path = tmp_path / "whole.txt"
    whole = [(a, "f" * 64 if a == "sha256" else d, k) for a, d, k in lines if ":" not in k]
    assert {a for a, _, _ in whole} == {"xxh64", "xxh3", "sha1", "sha256", "uuid"}
    path.write_text("".join(f"{a:<8}  {d}  {k}\n" for a, d, k in whole))
    return path


@pytest.mark.parametrize("command", ["load", "validate"])
def test_a_load_refuses_a_manifest_of_whole_model_lines_only(
    model: Path, whole_model: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, str(model), "--manifest", str(whole_model)]) == 2
    out = capsys.readouterr()
    (line,) = [line for line in (out.out + out.err).splitlines() if str(whole_model) in line]
    assert "whole-model lines only" in line
    assert f"aiogguf verify {model} --manifest {whole_model}" in line
    assert "validated" not in out.out + out.err


def test_the_library_load_refuses_it_too(model: Path, whole_model: Path) -> None:
    with (
        pytest.raises(ManifestError, match="aiogguf verify"),
        aiogguf.load_sync(model, manifest=str(whole_model)),
    ):
        pass


def test_verify_checks_a_manifest_of_whole_model_lines_only(
    model: Path, whole_model: Path, lines: list[tuple[str, str, str]], tmp_path: Path
) -> None:
    assert main(["verify", str(model), "--manifest", str(whole_model)]) == 2
    with pytest.raises(IntegrityError, match="sha256 differs"):
        verify_model_sync(model, whole_model)
    right = tmp_path / "right.txt"
    right.write_text("".join(f"{a:<8}  {d}  {k}\n" for a, d, k in lines if ":" not in k))
    assert main(["verify", str(model), "--manifest", str(right)]) == 0


# --- memory ----------------------------------------------------------------------------------


def _valid_json(tensors: int) -> str:
    """A valid manifest of ``tensors`` one-byte tensors: the most a 32 MiB one holds."""
    listed = tuple(TensorHash(f"{i:x}", 0, 64 + i, 1, bytes(16)) for i in range(tensors))
    end = 64 + tensors
    blocks = tuple(bytes(16) for _ in range(-(-tensors // (64 << 10))))
    files = (FileHashes("m.gguf", end, 64, end, bytes(32), bytes(16), blocks),)
    return manifest_json(Manifest(64 << 10, files, listed, compute_set_id(64 << 10, files, listed)))


def _fill(head: str, item: str, tail: str, sep: str = ",") -> str:
    n = (MAX_MANIFEST_BYTES - len(head) - len(tail)) // (len(item) + len(sep))
    return head + sep.join([item] * n) + tail


SHAPES: dict[str, Callable[[], str]] = {
    "tensors of {}": lambda: _fill('{"tensors": [', "{}", "]}"),
    "blocks of short strings": lambda: _fill('{"files": [{"blocks": [', '"ab"', "]}]}"),
    "an object of many fields": lambda: (
        "{" + ",".join(f'"{i:07x}":0' for i in range(MAX_MANIFEST_BYTES // 12 - 1)) + "}"
    ),
    "a list of {} (not JSON: llama lines)": lambda: _fill("[", "{}", "]"),
    "newlines": lambda: "\n" * MAX_MANIFEST_BYTES,
    "the smallest hash lines": lambda: _fill("", "xxh3 0000000000000000 k", "\n", "\n"),
    "a valid manifest of 300,000 tensors": lambda: _valid_json(300_000),
}


# The command line's load, in a process of its own that says its peak RSS at the end:
# VmHWM, its own memory's high-water mark (a child's ru_maxrss starts from its parent's,
# this test's, where the child was forked).
PEAK_OF_CLI = """
import sys
from aiogguf.cli import main
try:
    code = main(sys.argv[1:])
finally:
    with open("/proc/self/status") as status:
        print([ln for ln in status if ln.startswith("VmHWM:")][0].strip(), file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize("shape", SHAPES)
def test_a_32_mib_manifest_peaks_under_300_mb(model: Path, tmp_path: Path, shape: str) -> None:
    path = tmp_path / "hostile"
    text = SHAPES[shape]()
    assert MAX_MANIFEST_BYTES - MiB < len(text.encode()) <= MAX_MANIFEST_BYTES
    path.write_text(text)
    del text
    done = subprocess.run(
        [sys.executable, "-c", PEAK_OF_CLI, "validate", str(model), "--manifest", str(path)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    *said, peak = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 2, said  # refused,
    (line,) = said  # in one line
    assert str(path) in line  # naming the file
    peak_mb = int(peak.split()[1]) / 1024  # VmHWM: N kB
    assert peak_mb < PEAK_LIMIT_MB, f"{shape}: {peak_mb:.0f} MB"
