"""``Model.dequantize``: gguf-py's kernels on aiogguf's loaded bytes give what they give on
gguf-py's own reader, for every tensor of llama.cpp's files (the oracle: gguf-py alone)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import aiogguf

gguf = pytest.importorskip("gguf")
FILES = ["tiny-llama-Q4_K_M.gguf", "tiny-llama-Q5_1-bf16emb.gguf", "tiny-llama-IQ2_XS.gguf"]


@pytest.mark.parametrize("name", FILES)
def test_every_tensor_as_gguf_py_dequantizes_it(name: str, reference_dir: Path) -> None:
    reader = gguf.GGUFReader(reference_dir / name)
    with aiogguf.load_sync(reference_dir / name, n_gpu_layers=0) as model:
        for tensor in reader.tensors:
            want = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            got = model.dequantize(tensor.name)
            assert got.dtype == np.float32
            assert got.shape == tuple(reversed(tensor.shape.tolist())), tensor.name
            np.testing.assert_array_equal(got, want.reshape(got.shape), err_msg=tensor.name)
        assert model.dequantize(reader.tensors[1].name, np.float16).dtype == np.float16


def test_bf16_is_read_as_numbers(reference_dir: Path) -> None:
    with aiogguf.load_sync(reference_dir / "tiny-llama-Q5_1-bf16emb.gguf") as model:
        name = next(n for n in model.tensors if model.index[n].type.name == "BF16")
        bits = np.asarray(model.tensors[name]).astype(np.uint32) << 16
        np.testing.assert_array_equal(model.dequantize(name), bits.view(np.float32))
