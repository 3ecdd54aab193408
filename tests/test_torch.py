"""``Model.torch`` / ``Model.torch_tensors``: torch tensors over the loaded memory.

Oracles: the model's own arrays (the same address, so no copy was made), the file's
bytes (``Model.raw``), numpy's float32 for BF16 (the bits shifted up 16), and gguf-py's
``quant_shape_to_byte_shape`` for the quantized shape. The device path runs on a
simulated GPU and on the CuPy stand-in everywhere, and on a real GPU (``gpu``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from upload_helpers import cupy_stand_in_backend

import aiogguf
from aiogguf.io._devices.cupy_backend import cupy_devices, import_cupy
from aiogguf.testing.synth import SynthModel, write_synthetic_model

torch = pytest.importorskip("torch")
quants = pytest.importorskip("gguf.quants")

DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
}


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    folder = tmp_path_factory.mktemp("torch")
    return write_synthetic_model(
        folder / "all.gguf", size_bytes="2MiB", seed=5, types="all-types", include_q2_0=False
    )


def address(array: Any) -> int:
    if hasattr(array, "data") and hasattr(array.data, "ptr"):  # CuPy (or its stand-in)
        return int(array.data.ptr)
    return int(array.__array_interface__["data"][0])


def expected_shape(array: Any, type_name: str) -> tuple[int, ...]:
    if type_name in DTYPES:
        return tuple(array.shape)
    ggml = quants.GGMLQuantizationType[type_name]
    logical = (*array.shape[:-2], array.shape[-2] * quants.GGML_QUANT_SIZES[ggml][0])
    return tuple(quants.quant_shape_to_byte_shape(logical, ggml))


def check_tensor(model: aiogguf.Model, name: str, tensor: Any) -> None:
    entry = model.index[name]
    array = model.tensors[name]
    assert tensor.data_ptr() == address(array), f"{name}: copied"
    assert tensor.dtype == DTYPES.get(entry.type.name, torch.uint8), name
    assert tuple(tensor.shape) == expected_shape(array, entry.type.name), name
    host = tensor.cpu().contiguous().view(torch.uint8).numpy()
    assert host.tobytes() == bytes(model.raw(name)), name


def test_host_tensors_share_memory_with_ggml_dtypes(synth: SynthModel) -> None:
    with aiogguf.load_sync(synth.path, mode="none", n_gpu_layers=0) as model:
        names = [t.name for t in synth.tensors]
        assert {model.index[n].type.name for n in names} >= set(DTYPES) - {"F64"}
        for name in names:
            tensor = model.torch(name)
            assert tensor.device.type == "cpu"
            check_tensor(model, name, tensor)
        assert list(model.torch_tensors()) == list(model.tensors)


def test_bf16_values_are_the_numbers_not_the_bits(synth: SynthModel) -> None:
    with aiogguf.load_sync(synth.path, mode="none", n_gpu_layers=0) as model:
        (name,) = [t.name for t in synth.tensors_of_type("BF16")][:1]
        bits = np.asarray(model.tensors[name]).astype(np.uint32) << 16
        expected = bits.view(np.float32)
        got = model.torch(name).float().numpy()
        np.testing.assert_array_equal(got, expected)


def test_quantized_rows_dequantize_with_gguf_py(synth: SynthModel) -> None:
    with aiogguf.load_sync(synth.path, mode="none", n_gpu_layers=0) as model:
        (name,) = [t.name for t in synth.tensors_of_type("Q8_0")][:1]
        entry = model.index[name]
        rows = model.torch(name).numpy()
        values = quants.dequantize(rows, quants.GGMLQuantizationType.Q8_0)
        assert values.shape == tuple(reversed(entry.shape))


def test_mode_none_tensors_are_writable_and_shared(synth: SynthModel) -> None:
    with aiogguf.load_sync(synth.path, mode="none", n_gpu_layers=0) as model:
        name = synth.tensors_of_type("F32")[0].name
        assert model.writable(name)
        tensor = model.torch(name)
        tensor.view(-1)[0] = 12.5
        assert np.asarray(model.tensors[name]).reshape(-1)[0] == 12.5


def test_mapped_tensors_share_the_mapping(synth: SynthModel) -> None:
    """A mapped model's numpy arrays are read-only; its torch tensors are over the same
    pages (no copy), copy-on-write. The writes run in processes of their own, where a
    crash cannot take pytest with it: here, and for every way of writing in
    ``test_mapped_writes.py``."""
    with aiogguf.load_sync(synth.path, mode="mmap", n_gpu_layers=0) as model:
        assert not any(model.writable(name) for name in model.tensors)
        name = synth.tensors_of_type("F32")[0].name
        assert not model.tensors[name].flags.writeable
        check_tensor(model, name, model.torch(name))


def test_torch_is_imported_with_the_first_tensor(synth: SynthModel) -> None:
    """``import aiogguf`` and a load do not import torch; the first tensor does (and a
    write into a mapped one leaves the process running: its pages are copy-on-write)."""
    name = synth.tensors_of_type("F32")[0].name
    script = textwrap.dedent(
        f"""
        import sys
        import aiogguf
        with aiogguf.load_sync({str(synth.path)!r}, mode="mmap", n_gpu_layers=0) as model:
            print("torch" in sys.modules, flush=True)
            tensor = model.torch({name!r})
            print("torch" in sys.modules, flush=True)
            tensor.fill_(1.0)
            print(float(model.tensors[{name!r}].reshape(-1)[0]), flush=True)
            with aiogguf.load_sync({str(synth.path)!r}, mode="mmap", n_gpu_layers=0) as again:
                print(bool((again.tensors[{name!r}] == 1.0).all()), flush=True)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=90
    )
    assert done.returncode == 0, done.stderr
    # The write shows in the model that made it, not in a second load of the file.
    assert done.stdout.split() == ["False", "True", "1.0", "False"], done.stderr


# --- devices ----------------------------------------------------------------------------


@pytest.fixture(
    params=[
        pytest.param("sim", id="sim"),
        pytest.param("stand-in", id="cupy-stand-in"),
        pytest.param("cupy", id="cupy", marks=pytest.mark.gpu),
    ]
)
def offload(request: pytest.FixtureRequest) -> Iterator[tuple[dict[str, Any], str]]:
    """Overrides that put every layer on one GPU, and the torch device type expected."""
    if request.param == "sim":
        yield {"n_gpu_layers": -1, "sim_gpus": ["name=g0,free=2GiB"]}, "cpu"
        return
    if request.param == "stand-in":
        with cupy_stand_in_backend():
            # The stand-in's arrays are numpy's: DLPack says they are on the CPU.
            yield {"n_gpu_layers": -1}, "cpu"
        return
    if import_cupy() is None or not cupy_devices():
        pytest.skip("needs CuPy and a CUDA device")
    yield {"n_gpu_layers": -1}, "cuda"


def test_device_tensors_share_device_memory(
    synth: SynthModel, offload: tuple[dict[str, Any], str]
) -> None:
    overrides, device_type = offload
    with aiogguf.load_sync(synth.path, mode="none", **overrides) as model:
        on_device = [p.name for p in model.plan.tensors if p.device != "CPU"]
        assert len(on_device) > len(model.plan.tensors) // 2
        for name in on_device:
            tensor = model.torch(name)
            assert tensor.device.type == device_type
            if device_type == "cuda":
                assert tensor.device.index == model.tensors[name].device.id
            assert model.writable(name)
            check_tensor(model, name, tensor)


def test_torch_is_an_extra_not_a_dependency() -> None:
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert 'torch = ["torch==2.13.0"]' in text
    assert "torch" not in text.split("dependencies = [", 1)[1].split("]", 1)[0]
