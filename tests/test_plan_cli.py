"""``aiogguf plan`` on every llama.cpp reference file with two simulated GPUs: the readable
plan, and ``--json`` with exactly the documented keys, checked against MANIFEST.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import REFERENCE_DIR

from aiogguf.cli import main

NAMES = sorted(p.name for p in REFERENCE_DIR.glob("*.gguf")) or ["<missing>"]
LATER_SPLITS = {n for n in NAMES if "-split-" in n and "-00001-of-" not in n}
FIRST_FILES = [n for n in NAMES if n not in LATER_SPLITS]
SIM = ["--sim-gpu", "name=g0,free=8GiB", "--sim-gpu", "name=g1,free=4GiB"]

TOP_KEYS = {
    "devices",
    "input_device",
    "layers",
    "tensors",
    "buffers",
    "moved",
    "warnings",
    "cpu_extra_buffers",
}
DEVICE_KEYS = {"name", "kind", "free", "total"}
TENSOR_KEYS = {"name", "layer", "class", "device", "buffer_type", "nbytes", "lazy", "moved"}
BUFFER_KEYS = {"device", "buffer_type", "lazy", "nbytes", "n_tensors"}


def _manifest(reference_dir: Path, name: str) -> list[dict[str, Any]]:
    """The manifest entries of ``name`` and, for a first split, of its siblings."""
    entries: list[dict[str, Any]] = json.loads((reference_dir / "MANIFEST.json").read_text())
    if "-split-" in name:
        prefix = name.split("-split-")[0]
        return sorted((e for e in entries if e["file"].startswith(prefix + "-split-")),
                      key=lambda e: e["file"])  # fmt: skip
    return [e for e in entries if e["file"] == name]


def _plan_json(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    assert main(["plan", str(path), *SIM, "--json", *extra]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


@pytest.mark.parametrize("name", FIRST_FILES)
def test_plan_json_on_reference(
    reference_dir: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    entries = _manifest(reference_dir, name)
    data = _plan_json(reference_dir / name, capsys)
    assert set(data) == TOP_KEYS
    assert [d["name"] for d in data["devices"]] == ["CPU", "g0", "g1"]
    assert all(set(d) == DEVICE_KEYS for d in data["devices"])
    assert data["devices"][1]["free"] == 8 * 1024**3
    assert data["input_device"] == "CPU"

    n_layer = entries[0]["block_count"]
    assert [a["layer"] for a in data["layers"]] == list(range(n_layer + 1))
    # Free memory 8:4 → the first two thirds of the layers on g0, the rest on g1.
    devices = [a["device"] for a in data["layers"]]
    n_g0 = devices.count("g0")
    assert devices == ["g0"] * n_g0 + ["g1"] * (n_layer + 1 - n_g0)
    assert n_g0 == sum(1 for k in range(n_layer + 1) if k / (n_layer + 1) < 2 / 3)

    expected = {t["name"]: t for e in entries for t in e["tensors"]}
    assert {t["name"] for t in data["tensors"]} == set(expected)
    for t in data["tensors"]:
        assert set(t) == TENSOR_KEYS
        assert t["nbytes"] == expected[t["name"]]["n_bytes"]
        if t["class"] == "input":
            assert (t["device"], t["buffer_type"], t["layer"]) == ("CPU", "CPU", None)
        else:
            assert t["device"] == devices[t["layer"]], t
            assert t["buffer_type"] == t["device"]
            assert not t["moved"]
        assert not t["lazy"]

    assert all(set(b) == BUFFER_KEYS for b in data["buffers"])
    assert sum(b["nbytes"] for b in data["buffers"]) == sum(t["n_bytes"] for t in expected.values())
    assert sum(b["n_tensors"] for b in data["buffers"]) == len(expected)
    if expected:
        # mmap (auto) turns the pinned-host choice of the input layer into plain CPU.
        assert data["moved"] == {
            "count": 1,
            "first": {"name": "token_embd.weight", "type": expected["token_embd.weight"]["type"],
                      "from": "g0_Host", "to": "CPU"},
        }  # fmt: skip
    else:
        assert data["moved"] is None
        assert data["buffers"] == []
    assert data["warnings"] == []


@pytest.mark.parametrize("name", FIRST_FILES)
def test_plan_text_on_reference(
    reference_dir: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(reference_dir / name), *SIM]) == 0
    out = capsys.readouterr().out
    assert "load mode: mmap" in out
    assert "input layer (token embedding): CPU" in out
    assert "g0" in out
    assert "g1" in out
    if "vocab" not in name:
        assert "layers 0-3: g0" in out
        assert "layer 4 (4 = output): g1" in out
        assert "cannot use preferred buffer type g0_Host, using CPU instead" in out


def test_plan_cli_flags(reference_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = reference_dir / "tiny-llama-IQ1_M.gguf"
    data = _plan_json(
        path, capsys, "-ngl", "3", "-ot", "ffn_down=CPU", "--mode", "none", "-ts", "1,1"
    )
    assert [a["device"] for a in data["layers"]] == ["CPU", "CPU", "g0", "g0", "g1"]
    down = next(t for t in data["tensors"] if t["name"] == "blk.3.ffn_down.weight")
    assert (down["device"], down["buffer_type"], down["moved"]) == ("g0", "g0_Host", True)

    unsupported = ["--sim-gpu", "name=g2,free=1GiB,unsupported=IQ1_M"]
    assert main(["plan", str(path), *unsupported, "--json", "--mode", "none"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["moved"]["first"]["type"] == "IQ1_M"
    assert (data["moved"]["first"]["from"], data["moved"]["first"]["to"]) == ("g2", "CPU")


def test_plan_cli_errors(reference_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = reference_dir / "tiny-llama-Q4_0.gguf"
    assert main(["plan", str(path), *SIM, "-sm", "none", "-mg", "5"]) == 2
    assert "invalid main_gpu 5" in capsys.readouterr().err
    assert main(["plan", str(path), *SIM, "-ot", "x=CUDA9"]) == 2
    assert "unknown buffer type or device 'CUDA9'" in capsys.readouterr().err


def test_plan_from_config_file(
    reference_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "two-gpus.toml"
    config.write_text(
        '[load]\nmode = "none"\n'
        "[placement]\nn_gpu_layers = 2\n"
        '[[placement.override]]\npattern = "attn_q"\nbuffer_type = "b"\n'
        '[[device]]\nname = "a"\nfree = "6GiB"\n'
        '[[device]]\nname = "b"\nfree = "2GiB"\npinned_host = false\n'
    )
    path = reference_dir / "tiny-llama-Q8_0.gguf"
    assert main(["plan", str(path), "--config", str(config), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in data["devices"]] == ["CPU", "a", "b"]
    assert [a["device"] for a in data["layers"]] == [
        "CPU",
        "CPU",
        "CPU",
        "a",
        "a",
    ]  # 6:2 → both on a
    q = next(t for t in data["tensors"] if t["name"] == "blk.0.attn_q.weight")
    assert (q["device"], q["buffer_type"], q["moved"]) == ("b", "b", True)
    assert {b["buffer_type"] for b in data["buffers"]} == {"a", "a_Host", "b"}
