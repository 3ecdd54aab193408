"""Work bounded by the bytes of the file (issue 24, item 1): a header value that drives a
loop or an allocation of parse, index or plan is checked against what the file holds, or
against a cap named in docs/format.md, before anything uses it."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from gguf_fields import metadata_value_field, set_field

from aiogguf._config import Config
from aiogguf._core.assemble import open_index
from aiogguf._names import MAX_LAYERS
from aiogguf._records import ParsedFile
from aiogguf.errors import GGUFFormatError, SplitError
from aiogguf.io._devices.cpu import CpuDevice
from aiogguf.stages import parse as parse_module
from aiogguf.stages.index import build_index
from aiogguf.stages.parse import parse_header
from aiogguf.stages.plan import make_plan

TINY = "tiny-llama-Q4_0.gguf"  # 4 layers: blk.0 … blk.3


def _with_block_count(reference_dir: Path, value: int, *, vt: int | None = None) -> bytes:
    buf = (reference_dir / TINY).read_bytes()
    field = metadata_value_field(buf, "llama.block_count")
    if vt is not None:
        type_field = metadata_value_field(buf, "llama.block_count type")
        buf = set_field(buf, type_field, vt)
    return set_field(buf, field, value)


def test_finding_1_block_count_2_31_plan_cli_refuses_at_once(
    reference_dir: Path, tmp_path: Path
) -> None:
    """`aiogguf plan` of the 1.7 MB file with block_count 2^31 ran for ever at GBs of RSS
    (``assign_layers`` looped over every layer); now it exits 2 naming the key."""
    path = tmp_path / "huge-layers.gguf"
    path.write_bytes(_with_block_count(reference_dir, 2**31))
    proc = subprocess.run(
        [sys.executable, "-m", "aiogguf", "plan", str(path)],
        capture_output=True,
        text=True,
        timeout=20,  # today: still running (and growing) after 15 s
    )
    assert proc.returncode == 2, proc.stderr
    assert "llama.block_count" in proc.stderr
    assert str(MAX_LAYERS) in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("value", [MAX_LAYERS + 1, 2**31, 2**32 - 1])
def test_block_count_beyond_the_cap_is_a_format_error_naming_the_key(
    reference_dir: Path, value: int
) -> None:
    buf = _with_block_count(reference_dir, value)
    parsed = parse_header(buf, TINY, len(buf))
    with pytest.raises(GGUFFormatError, match=r"llama\.block_count") as info:
        build_index((parsed,))
    assert info.value.offset == parsed.metadata["llama.block_count"].offset
    assert f"{value}" in str(info.value)


@pytest.mark.parametrize("value", [5, 100, MAX_LAYERS])
def test_empty_layers_up_to_the_cap_are_a_warning(reference_dir: Path, value: int) -> None:
    buf = _with_block_count(reference_dir, value)
    index = build_index((parse_header(buf, TINY, len(buf)),))
    assert any("llama.block_count" in w and "empty" in w for w in index.warnings)
    plan = make_plan(index, [CpuDevice()], Config())
    assert len(plan.layers) == value + 1


def test_negative_block_count_is_a_format_error(reference_dir: Path) -> None:
    buf = _with_block_count(reference_dir, 2**32 - 1, vt=5)  # int32 -1
    parsed = parse_header(buf, TINY, len(buf))
    assert parsed.metadata["llama.block_count"].value == -1
    with pytest.raises(GGUFFormatError, match=r"llama\.block_count.*negative"):
        build_index((parsed,))


def test_plan_of_the_largest_allowed_layer_count_is_small(reference_dir: Path) -> None:
    buf = _with_block_count(reference_dir, MAX_LAYERS)
    tracemalloc.start()
    try:
        index = build_index((parse_header(buf, TINY, len(buf)),))
        make_plan(index, [CpuDevice()], Config())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


@pytest.mark.asyncio
async def test_split_count_drives_no_work_beyond_the_files_there(
    reference_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first split whose ``split.count`` says 65535 (a 1.7 MB file, its siblings
    missing) made one task per split, each failing to open its file: 17 s and 700 MB.
    Now the splits are parsed by a few workers in order, which stop at the first
    missing one."""
    source = reference_dir / "tiny-llama-Q4_K_M-split-00001-of-00003.gguf"
    buf = source.read_bytes()
    path = tmp_path / "m-00001-of-65535.gguf"
    path.write_bytes(set_field(buf, metadata_value_field(buf, "split.count"), 65535))
    tried: list[str] = []
    original = parse_module.parse_file

    async def counted(split: str | os.PathLike[str], **kwargs: Any) -> ParsedFile:
        tried.append(os.fspath(split))
        return await original(split, **kwargs)

    monkeypatch.setattr(parse_module, "parse_file", counted)
    with pytest.raises(SplitError, match=r"split 2 of 65535 is missing"):
        await open_index(path)
    assert len(tried) <= 1 + 8  # the first, and at most one per worker
