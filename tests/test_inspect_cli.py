"""``aiogguf inspect``: the JSON shape, the readable summary, exit statuses and messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aiogguf.cli import main
from aiogguf.errors import GGUFFormatError

FILE_KEYS = {"path", "version", "byte_order", "alignment", "data_offset", "size", "n_tensors"}
TENSOR_KEYS = {"name", "type", "shape", "file", "offset", "nbytes", "layer", "class"}
SPLIT_FIRST = "tiny-llama-Q4_K_M-split-00001-of-00003.gguf"


def test_json_through_a_subprocess(reference_dir: Path, tmp_path: Path) -> None:
    # cwd away from the repository root: our io/ folder must not shadow the stdlib there.
    done = subprocess.run(
        [sys.executable, "-m", "aiogguf", "inspect", "--json", str(reference_dir / SPLIT_FIRST)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.count("\n") == 1  # one JSON object on one line
    result: dict[str, Any] = json.loads(done.stdout)
    assert set(result) == {"files", "metadata", "tensors", "totals"}
    assert [set(f) for f in result["files"]] == [FILE_KEYS] * 3
    assert [f["byte_order"] for f in result["files"]] == ["little"] * 3
    assert all(set(t) == TENSOR_KEYS for t in result["tensors"])
    assert {t["file"] for t in result["tensors"]} == {0, 1, 2}
    assert set(result["totals"]) == {"n_tensors", "nbytes", "n_elements", "bpw"}
    tokens = result["metadata"]["tokenizer.ggml.tokens"]
    assert tokens["type"] == "array"
    assert tokens["item_type"] == "string"
    assert len(tokens["value"]) == 1024  # complete, never abbreviated
    assert result["metadata"]["split.count"] == {"type": "uint16", "value": 3}
    assert result["metadata"]["split.tensors.count"] == {"type": "int32", "value": 39}


def test_readable_summary(reference_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(reference_dir / "tiny-llama-Q4_K_M.gguf")]) == 0
    out = capsys.readouterr().out
    for text in ("files", "metadata", "tensors (by layer)", "tensor types", "Q6_K", "Q4_K"):
        assert text in out
    assert "[1024 × string]" in out  # a long array, abbreviated
    assert "'<0x10>'" not in out  # its 20th token is not shown
    assert "39 tensors" in out
    assert "bits per weight" in out


def test_bad_file_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + b"\0" * 60)
    assert main(["inspect", "--json", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"aiogguf inspect: {path}: at offset 0: magic: "
        "expected b'GGUF', found b'GGML': not a GGUF file\n"
    )


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "nope.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "nope.gguf" in err
    assert "cannot open" in err


def test_unexpected_error_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(path: str) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr("aiogguf.cli.inspect.index_local_file", broken)
    assert main(["inspect", str(tmp_path / "x.gguf")]) == 1
    assert capsys.readouterr().err == "aiogguf inspect: RuntimeError: boom\n"


def test_debug_shows_the_exception(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\x07\0\0\0")
    with pytest.raises(GGUFFormatError, match="unsupported GGUF version 7"):
        main(["inspect", "--debug", str(path)])


def test_every_reference_file_has_a_summary(
    reference_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """llama.cpp's vocab-only file has no tensors: its table is the header alone."""
    files = sorted(
        p for p in reference_dir.glob("*.gguf") if "-split-" not in p.name or "00001-of" in p.name
    )
    assert len(files) >= 20
    for path in files:
        assert main(["inspect", str(path)]) == 0, path.name
        assert "tensors (by layer)" in capsys.readouterr().out


def test_a_file_without_tensors_has_a_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "0 tensors" in out
    assert "tokenizer.ggml.tokens" in out
