"""The small frictions a newcomer met: metadata arrays are sequences, and the files'
tensor order is offered beside llama.cpp's load order."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

import aiogguf
from aiogguf.records import GGUFArray, ValueType
from aiogguf.testing.synth import write_synthetic_model

gguf = pytest.importorskip("gguf")


def test_a_vocabulary_is_a_sequence(reference_dir: Path) -> None:
    index = aiogguf.inspect_sync(reference_dir / "ggml-vocab-llama-spm.gguf")
    tokens = index.metadata["tokenizer.ggml.tokens"].value
    scores = index.metadata["tokenizer.ggml.scores"].value
    assert isinstance(tokens, GGUFArray)
    assert isinstance(scores, GGUFArray)
    assert isinstance(tokens, Sequence)
    reader = gguf.GGUFReader(reference_dir / "ggml-vocab-llama-spm.gguf")
    want = reader.fields["tokenizer.ggml.tokens"].contents()
    assert list(tokens) == want
    assert tokens[5] == want[5]
    assert tokens[-1] == want[-1]
    assert list(tokens[10:13]) == want[10:13]
    assert want[100] in tokens
    assert tokens.index(want[100]) == want.index(want[100])
    assert float(scores[7]) == reader.fields["tokenizer.ggml.scores"].contents(7)
    assert [float(x) for x in scores][:4] == reader.fields["tokenizer.ggml.scores"].contents()[:4]


def test_a_nested_array_is_a_sequence_of_sequences() -> None:
    inner = GGUFArray(ValueType.INT32, np.arange(3, dtype=np.int32))
    outer = GGUFArray(ValueType.ARRAY, (inner, inner))
    assert [list(map(int, x)) for x in outer] == [[0, 1, 2], [0, 1, 2]]
    assert outer[1] is inner


def test_file_order_beside_load_order(tmp_path: Path) -> None:
    synth = write_synthetic_model(tmp_path / "m.gguf", size_bytes="1MiB", seed=8, n_layer=3)
    index = aiogguf.inspect_sync(synth.path)
    in_file = [t.name for t in synth.tensors]  # the writer's order: the file's
    assert [t.name for t in index.file_order] == in_file
    assert [t.name for t in gguf.GGUFReader(synth.path).tensors] == in_file
    assert sorted(t.name for t in index.tensors) == sorted(in_file)
    assert [t.name for t in index.tensors] != in_file  # a load's order differs here
    with aiogguf.load_sync(synth.path, n_gpu_layers=0) as model:
        assert list(model.tensors) == [t.name for t in index.tensors]
