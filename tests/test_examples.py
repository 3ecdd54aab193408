"""examples/: each runs, on llama.cpp's own files, and stays as short as it says."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest

import aiogguf

torch = pytest.importorskip("torch")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> dict[str, Any]:
    """The example's globals, run as a module (not as ``__main__``)."""
    return runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name=f"example_{name}")


def test_vllm_style_iterator(reference_dir: Path) -> None:
    source = (EXAMPLES / "vllm_style_iterator.py").read_text().splitlines()
    assert len(source) < 40
    path = reference_dir / "tiny-llama-Q4_K_M.gguf"
    pairs = list(example("vllm_style_iterator")["gguf_weights"](str(path), mode="none"))
    names = [name for name, _ in pairs]
    assert len(set(names)) == len(names)
    index = aiogguf.inspect_sync(path)
    quantized = [e for e in index.tensors if e.type.is_quantized]
    assert len(pairs) == len(index.tensors) + len(quantized) > 0
    got = dict(pairs)
    assert (
        got["model.layers.0.self_attn.q_proj.qweight_type"].item()
        == index["blk.0.attn_q.weight"].type.id
    )
    assert got["lm_head.qweight"].dtype == torch.uint8
    assert got["model.norm.weight"].dtype == torch.float32
    n_layer = index.n_layer
    assert n_layer is not None
    assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {
        str(i) for i in range(n_layer)
    }
    # The tensors were shared with the model while it was open: their bytes are the file's.
    with open(path, "rb") as f:
        entry = index["output_norm.weight"]
        f.seek(entry.offset)
        assert got["model.norm.weight"].numpy().tobytes() == f.read(entry.nbytes)
