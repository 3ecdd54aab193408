"""The small frictions a newcomer met: metadata arrays are sequences, the files' tensor
order is offered beside llama.cpp's load order, and messages read as text (paths with
their control characters escaped, enums by their values, counts that agree with their
nouns, the extra that installs a missing package)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

import aiogguf
from aiogguf._config import Config
from aiogguf._records import GGUFArray, ValueType
from aiogguf._units import counted
from aiogguf.cli.extras import EXTRAS, MissingExtraError, needs_extra
from aiogguf.errors import (
    ConfigError,
    GGUFError,
    GGUFFormatError,
    IntegrityError,
    LoadError,
    ManifestError,
    PathNotAllowedError,
    PlacementError,
    SplitError,
    TensorFailure,
    TensorValidationError,
    shown_path,
)
from aiogguf.server._policy import RequestRefused, ServerPolicy, request_config, server_base_config
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


# --- messages -----------------------------------------------------------------------------


def test_a_path_is_shown_with_its_control_characters_escaped() -> None:
    assert shown_path("/models/modèle 7b.gguf") == "/models/modèle 7b.gguf"
    assert shown_path("/m/a\nb\x1b[2J\tc\u2028.gguf") == "/m/a\\nb\\x1b[2J\\tc\\u2028.gguf"
    assert shown_path(b"/m/\xff.gguf") == "/m/\\udcff.gguf"  # undecodable: a surrogate
    assert shown_path(Path("/m/x\r.gguf")) == "/m/x\\r.gguf"


@pytest.mark.parametrize(
    "error",
    [
        LoadError("/m/a\nb.gguf", 7, "short read"),
        GGUFFormatError("/m/a\nb.gguf", 7, "magic", "not GGUF"),
        SplitError("/m/a\nb.gguf", "split 2 of 3 is missing"),
        ManifestError("/m/a\nb.json", "sha256", "expected 64 hex digits"),
        ConfigError("mode", "/etc/a\nb.toml", "unknown"),
        PathNotAllowedError("/m/a\nb.gguf"),
        IntegrityError([], "/m/a\nb.gguf", "sha256 differs"),
        # A path, or a file's own string, inside the problem.
        SplitError("/m/x.gguf", "split 2 of 3 is missing (needed by /m/a\nb.gguf)"),
        PlacementError("tensor 'a\nb.weight' belongs to layer 9"),
        TensorValidationError([TensorFailure("a\nb.w", "F32", "found nan", 0, 1)], "/m/x.gguf"),
    ],
)
def test_error_messages_keep_a_path_on_one_line(error: GGUFError) -> None:
    """A newline in a path reached stderr raw. The message escapes it; the error's
    ``path`` (or ``source``) stays the path as given."""
    lines = str(error).splitlines()
    assert "a\\nb." in lines[-1]
    # One line, but for the list of a TensorValidationError (one line per tensor).
    assert len(lines) == (2 if type(error) is TensorValidationError else 1)
    given = getattr(error, "path", None) or getattr(error, "source", None)
    if given not in (None, "/m/x.gguf"):  # the path in the message's first part
        assert "a\nb." in given


def test_counts_agree_with_their_nouns() -> None:
    assert counted(1, "file") == "1 file"
    assert [counted(n, "file") for n in (0, 2)] == ["0 files", "2 files"]
    assert counted(1, "tensor differs", "tensors differ") == "1 tensor differs"
    assert counted(3, "tensor differs", "tensors differ") == "3 tensors differ"


def test_a_refused_mode_is_named_by_its_value() -> None:
    """The server said ``mode <LoadMode.DIRECT: 'direct'> is not allowed``."""
    base = server_base_config(Config())
    with pytest.raises(RequestRefused) as refused:
        request_config(base, {"mode": "direct"}, ServerPolicy())
    assert refused.value.status == 403
    assert str(refused.value).startswith("request config: mode direct is not allowed")
    assert "LoadMode" not in str(refused.value)


def test_the_lazy_warning_names_the_mode_by_its_value(tmp_path: Path) -> None:
    synth = write_synthetic_model(tmp_path / "m.gguf", size_bytes="1MiB", seed=8, n_layer=2)
    plan = aiogguf.plan_sync(synth.path, lazy="on", mode="none", n_gpu_layers=0)
    (warning,) = [w for w in plan.warnings if w.startswith("lazy")]
    assert warning.startswith("lazy = 'on' needs a mapped load mode (mode = 'none'); ")
    assert "tensors are loaded in full" in warning


def test_a_missing_extra_names_what_installs_it() -> None:
    """Each optional package a command needs, said the same way (gguf's was, aiohttp's
    said "needs aiohttp" and exited 1)."""
    for module, extra in EXTRAS.items():
        with pytest.raises(MissingExtraError) as missing, needs_extra("the thing", module):
            raise ModuleNotFoundError(f"No module named '{module}'", name=module)
        assert str(missing.value) == (
            f"the thing needs {module}, which is not installed: pip install 'aiogguf[{extra}]'"
        )
    # Another module missing is a broken install, not an extra: it is not turned into one.
    with pytest.raises(ModuleNotFoundError), needs_extra("the server", "aiohttp"):
        raise ModuleNotFoundError("No module named 'multidict'", name="multidict")
