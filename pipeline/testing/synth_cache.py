"""Synthetic models kept on disk and reused while complete: the demo's, the benchmarks'.

``ensure_synthetic_model`` writes a model (``aiogguf.testing.synth``) once, with a JSON
sidecar that records what was written, and reuses it while its files match the sidecar.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from aiogguf._units import format_bytes, format_size, parse_size
from aiogguf.testing.synth import GiB, SynthModel, SynthTensor, write_synthetic_model

__all__ = ["default_demo_path", "ensure_bench_model", "ensure_synthetic_model"]

_SIDECAR_VERSION = 1


def default_demo_path(
    dir: str | os.PathLike[str] | None = None,
    *,
    size_bytes: int | str = GiB,
    seed: int = 0,
    types: str = "mixed",
) -> Path:
    """Where the demo model of this size, seed and preset lives: ``dir``, else
    ``$XDG_CACHE_HOME/aiogguf``, else ``~/.cache/aiogguf``; e.g. ``demo-1GiB-s0.gguf``.
    Creates nothing."""
    if dir is not None:
        base = Path(dir)
    else:
        cache = os.environ.get("XDG_CACHE_HOME")
        base = (Path(cache) if cache else Path.home() / ".cache") / "aiogguf"
    suffix = "" if types == "mixed" else f"-{types}"
    return base / f"demo-{format_size(parse_size(size_bytes))}-s{seed}{suffix}.gguf"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def ensure_synthetic_model(
    path: str | os.PathLike[str],
    *,
    size_bytes: int | str = GiB,
    seed: int = 0,
    split_count: int = 1,
    big_endian: bool = False,
    types: str | None = None,
    n_layer: int | None = None,
) -> tuple[SynthModel, bool]:
    """Reuse the model at ``path`` if an earlier call wrote it with these arguments and
    it is complete, else write it (creating the folder). Returns ``(model, written)``.

    Completeness: a sidecar ``<name>.json`` is written last, holding the arguments and
    every file's size; any mismatch means rewrite. Raises as ``write_synthetic_model``.
    """
    out = Path(path)
    params: dict[str, Any] = {
        "version": _SIDECAR_VERSION,
        "size_bytes": parse_size(size_bytes),
        "seed": seed,
        "split_count": split_count,
        "big_endian": big_endian,
        "types": types or ("float" if big_endian else "mixed"),
        "n_layer": n_layer,
    }
    sidecar = _sidecar(out)
    try:
        saved = json.loads(sidecar.read_text())
        if saved["params"] == params:
            model = _model_from_sidecar(out, saved)
            if all(
                p.stat().st_size == n for p, n in zip(model.paths, saved["file_bytes"], strict=True)
            ):
                return model, False
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, stale or damaged: write afresh
    sidecar.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = write_synthetic_model(
        out,
        size_bytes=params["size_bytes"],
        seed=seed,
        split_count=split_count,
        big_endian=big_endian,
        types=params["types"],
        n_layer=n_layer,
    )
    record = {
        "params": params,
        "file_bytes": [p.stat().st_size for p in model.paths],
        "model": {
            # Names only: the folder is the caller's, whatever the working directory.
            "names": [p.name for p in model.paths],
            **{k: getattr(model, k) for k in _SCALAR_FIELDS},
            "tensors": [
                [t.name, t.type_id, list(t.shape), t.nbytes, t.shard, t.offset, t.file_offset]
                for t in model.tensors
            ],
        },
    }
    tmp = sidecar.with_name(sidecar.name + ".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(sidecar)
    return model, True


_SCALAR_FIELDS = (
    "preset",
    "seed",
    "big_endian",
    "n_layer",
    "n_embd",
    "n_ff",
    "n_head",
    "n_head_kv",
    "n_vocab",
    "n_tensors",
    "tensor_bytes",
    "file_bytes",
)


def _model_from_sidecar(path: Path, saved: dict[str, Any]) -> SynthModel:
    m = saved["model"]
    tensors = tuple(
        SynthTensor(name, type_id, tuple(shape), nbytes, shard, offset, file_offset)
        for name, type_id, shape, nbytes, shard, offset, file_offset in m["tensors"]
    )
    return SynthModel(
        paths=tuple(path.with_name(name) for name in m["names"]),
        tensors=tensors,
        **{k: m[k] for k in _SCALAR_FIELDS},
    )


def ensure_bench_model(directory: str | os.PathLike[str], size: int | str) -> tuple[Path, bool]:
    """The benchmarks' shared synthetic model of ``size`` bytes in ``directory``
    (``bench-2GiB.gguf``, seed 0), so that every benchmark loads the same file. Returns
    ``(path, written)``; raises as ``ensure_synthetic_model``."""
    size_bytes = parse_size(size)
    path = Path(directory) / f"bench-{format_bytes(size_bytes).replace(' ', '')}.gguf"
    _, written = ensure_synthetic_model(path, size_bytes=size_bytes, seed=0)
    return path, written
