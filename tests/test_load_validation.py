"""A model with several bad tensors fails its load with ONE ``TensorValidationError``
that names every bad tensor and its first bad index; ``check_tensors=False`` (CLI
``--no-check``) loads it anyway; ``aiogguf validate`` exits 2 and lists them all.

Oracle: ``corrupt.expected_bad`` decodes the file's bytes with numpy's own float
conversions, independently of the validator's bit masks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from corrupt import expected_bad

import aiogguf
from aiogguf._checks import PieceCheck
from aiogguf._jobs import ReadJob
from aiogguf.cli import main
from aiogguf.errors import TensorFailure, TensorValidationError
from aiogguf.io.ggml_types import GGML_TYPES
from aiogguf.stages.validate import Validation
from aiogguf.testing.synth import Corruption, SynthModel, write_synthetic_model


@dataclass(frozen=True, slots=True)
class Damaged:
    clean: SynthModel
    bad: SynthModel
    # name → (type name, first bad index, how many bad) by the oracle
    expected: dict[str, tuple[str, int, int]]


def _file_bytes(path: Path, offset: int, n: int) -> np.ndarray:
    with open(path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(n), dtype=np.uint8).copy()


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Damaged:
    d = tmp_path_factory.mktemp("bad")
    args = {"size_bytes": "3MiB", "types": "all-types", "include_q2_0": False, "seed": 21}
    clean = write_synthetic_model(d / "clean.gguf", **args)  # type: ignore[arg-type]
    q4k = clean.tensors_of_type("Q4_K")[0].name
    f16 = clean.tensors_of_type("F16")[-1].name
    q80 = clean.tensors_of_type("Q8_0")[0].name
    bf16 = clean.tensors_of_type("BF16")[0].name
    corruptions = [
        Corruption(q4k, "nan_scale", 5),
        Corruption(q4k, "nan_scale", 9),
        Corruption(f16, "inf_element", 1234),
        # A failed flash write: three whole Q8_0 blocks (34 bytes each) of 0xFF.
        Corruption(q80, "ff_fill", 17, length=3 * 34),
        Corruption(bf16, "bf16_nan", 77),
    ]
    bad = write_synthetic_model(d / "bad.gguf", corruptions=corruptions, **args)  # type: ignore[arg-type]
    expected: dict[str, tuple[str, int, int]] = {}
    for t in bad.tensors:
        ggml = GGML_TYPES[t.type_id]
        first, count = expected_bad(_file_bytes(bad.path, t.file_offset, t.nbytes), ggml)
        if count:
            assert first is not None
            expected[t.name] = (ggml.name, first, count)
    assert expected == {
        q4k: ("Q4_K", 5, 2),
        f16: ("F16", 1234, 1),
        q80: ("Q8_0", 17, 3),
        bf16: ("BF16", 77, 1),
    }
    return Damaged(clean, bad, expected)


def _assert_names_every_failure(exc: TensorValidationError, damaged: Damaged) -> None:
    got = {f.name: (f.type_name, f.first_index, f.count) for f in exc.failures}
    assert got == damaged.expected
    message = str(exc)
    assert str(damaged.bad.path) in message
    assert f"found {len(damaged.expected)} " in message
    for name, (type_name, first, _count) in damaged.expected.items():
        line = next(ln for ln in message.splitlines() if f"'{name}'" in ln)
        assert f"({type_name})" in line, line
        assert f"first at index {first}" in line, line


@pytest.mark.parametrize("mode", ["none", "mmap", "direct"])
def test_every_bad_tensor_in_one_error(damaged: Damaged, mode: str) -> None:
    with (
        pytest.raises(TensorValidationError) as info,
        aiogguf.load_sync(damaged.bad.path, mode=mode, n_gpu_layers=0),
    ):
        pytest.fail("a model with bad tensors must not be returned")
    _assert_names_every_failure(info.value, damaged)


@pytest.mark.parametrize(
    ("mode", "slot"), [("none", "16MiB"), ("mmap", "16MiB"), ("direct", "16MiB"), ("none", "8KiB")]
)
def test_bad_tensors_on_simulated_gpus_are_found_too(
    damaged: Damaged, mode: str, slot: str
) -> None:
    # Device tensors are checked in their staging slots; 8 KiB slots cut blocks at every
    # slot edge, whose units are then fetched back from the device.
    with (
        pytest.raises(TensorValidationError) as info,
        aiogguf.load_sync(
            damaged.bad.path,
            mode=mode,
            sim_gpus=["1GiB", "1GiB"],
            n_gpu_layers=-1,
            staging_buffer_size=slot,
        ),
    ):
        pass
    _assert_names_every_failure(info.value, damaged)


def test_clean_twin_passes_on_simulated_gpus(damaged: Damaged) -> None:
    with aiogguf.load_sync(
        damaged.clean.path, sim_gpus=["1GiB"], n_gpu_layers=-1, staging_buffer_size="8KiB"
    ) as model:
        assert model.failures == ()
        assert model.report.validated == damaged.clean.n_tensors
        assert {u.device for u in model.report.uploads} == {"g0"}


def test_clean_twin_passes(damaged: Damaged) -> None:
    with aiogguf.load_sync(damaged.clean.path, n_gpu_layers=0) as model:
        assert model.failures == ()
        assert model.report.validated == damaged.clean.n_tensors
        assert model.report.stage("validate").items == damaged.clean.n_tensors


def test_no_check_loads_the_damaged_bytes(damaged: Damaged) -> None:
    with aiogguf.load_sync(damaged.bad.path, check_tensors=False, n_gpu_layers=0) as model:
        assert model.failures == ()
        assert model.report.validated == 0
        with pytest.raises(KeyError):
            model.report.stage("validate")
        for name in damaged.expected:
            t = damaged.bad.tensor(name)
            assert (
                bytes(model.raw(name))
                == _file_bytes(damaged.bad.path, t.file_offset, t.nbytes).tobytes()
            )


def test_keep_invalid_returns_the_model_with_its_failures(damaged: Damaged) -> None:
    with aiogguf.load_sync(damaged.bad.path, keep_invalid=True, n_gpu_layers=0) as model:
        got = {f.name: (f.type_name, f.first_index, f.count) for f in model.failures}
        assert got == damaged.expected
        assert len(model.tensors) == damaged.bad.n_tensors


def test_cli_validate_lists_every_bad_tensor(
    damaged: Damaged, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", str(damaged.bad.path), "-ngl", "0"]) == 2
    out = capsys.readouterr().out
    assert f"{len(damaged.expected)} bad tensors" in out
    for name, (type_name, first, count) in damaged.expected.items():
        line = next(ln for ln in out.splitlines() if name in ln)
        assert type_name in line, line
        assert str(first) in line, line
        assert str(count) in line, line


def test_cli_validate_clean_model(damaged: Damaged, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(damaged.clean.path), "-ngl", "0"]) == 0
    assert f"{damaged.clean.n_tensors} tensors valid" in capsys.readouterr().out


def test_cli_load_no_check(damaged: Damaged, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["load", str(damaged.bad.path), "--no-check", "-ngl", "0"]) == 0
    assert "loaded" in capsys.readouterr().out


def test_cli_load_with_checks_fails(damaged: Damaged, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["load", str(damaged.bad.path), "-ngl", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aiogguf load: ")
    for name in damaged.expected:
        assert name in err


# --- host tensors finished by the thread that checked their last bytes ---------------------


# Host loads in jobs of 64 KiB: a tensor's blocks are cut at the jobs' edges.
SMALL_JOBS: dict[str, Any] = {"mode": "none", "n_gpu_layers": 0, "chunk_size": "64KiB"}


def _every_block_bad(tmp_path: Path) -> tuple[SynthModel, str, int]:
    """A model whose biggest Q8_0 tensor is 0xFF from end to end: every block's scale is
    a NaN, those cut by a job's edge too (checked only once both jobs have landed)."""
    args = {"size_bytes": "3MiB", "types": "all-types", "include_q2_0": False, "seed": 4}
    clean = write_synthetic_model(tmp_path / "clean.gguf", **args)  # type: ignore[arg-type]
    q80 = max(clean.tensors_of_type("Q8_0"), key=lambda t: t.nbytes)
    fill = Corruption(q80.name, "ff_fill", 0, length=q80.nbytes)
    bad = write_synthetic_model(tmp_path / "bad.gguf", corruptions=[fill], **args)  # type: ignore[arg-type]
    first, count = expected_bad(
        _file_bytes(bad.path, q80.file_offset, q80.nbytes), GGML_TYPES[q80.type_id]
    )
    assert (first, count) == (0, q80.nbytes // 34)
    return bad, q80.name, count


@pytest.mark.parametrize("readers", [1, 2, 3])
def test_units_cut_by_jobs_are_checked_once_both_jobs_landed(
    tmp_path: Path, readers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs of 64 KiB cut the tensor's 34-byte blocks at their edges, and one to three
    readers land them in any order. Every block is counted once; each host tensor's check
    is finished inside ``Validation.job_checked``, on the thread that checked its last
    bytes (a reader, or a check thread where reads are checked apart), not by a call the
    loop sends to a check thread."""
    bad, name, count = _every_block_bad(tmp_path)
    inside = threading.local()
    finished: list[tuple[str, bool]] = []
    job_checked, finish_all = Validation.job_checked, Validation._finish_all

    def checked(self: Validation, job: ReadJob) -> None:
        inside.on = True
        try:
            job_checked(self, job)
        finally:
            inside.on = False

    def finishing(self: Validation, checks: Sequence[PieceCheck]) -> list[TensorFailure]:
        finished.extend((c.name, getattr(inside, "on", False)) for c in checks)
        return finish_all(self, checks)

    monkeypatch.setattr(Validation, "job_checked", checked)
    monkeypatch.setattr(Validation, "_finish_all", finishing)
    settings = {**SMALL_JOBS, "readers": readers}
    with pytest.raises(TensorValidationError) as info, aiogguf.load_sync(bad.path, **settings):
        pytest.fail("a model with a bad tensor must not be returned")
    got = {f.name: (f.first_index, f.count) for f in info.value.failures}
    assert got == {name: (0, count)}
    assert sorted(n for n, _ in finished) == sorted(t.name for t in bad.tensors)
    assert all(on for _, on in finished), [n for n, on in finished if not on]


def test_streamed_host_tensors_finished_by_readers_come_once_each(tmp_path: Path) -> None:
    """``tensors_as_ready`` hands on each good host tensor once, after its check finished
    on the thread that checked its last bytes, and never the bad one."""
    bad, name, _ = _every_block_bad(tmp_path)
    seen: list[str] = []

    async def main() -> None:
        settings = {**SMALL_JOBS, "readers": 2}
        async with aiogguf.load(bad.path, keep_invalid=True, **settings).tensors_as_ready() as it:
            async for got, _array in it:
                seen.append(got)

    anyio.run(main)
    assert sorted(seen) == sorted(t.name for t in bad.tensors if t.name != name)
