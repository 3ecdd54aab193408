"""Integrity: hash manifests (format §8), llama.cpp's ``llama-gguf-hash`` format,
the watchers that check bytes against them as a load lands them, and the public
``hash_model`` / ``verify_model`` / ``verify_sha256``. Its names are imported on first
use, so that the watchers a load with a manifest needs do not bring the rest."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiogguf.integrity._hashing import HashProgress as HashProgress
    from aiogguf.integrity._hashing import VerifyReport as VerifyReport
    from aiogguf.integrity._hashing import hash_model as hash_model
    from aiogguf.integrity._hashing import hash_model_llama as hash_model_llama
    from aiogguf.integrity._hashing import hash_model_llama_sync as hash_model_llama_sync
    from aiogguf.integrity._hashing import hash_model_sync as hash_model_sync
    from aiogguf.integrity._hashing import read_any_manifest as read_any_manifest
    from aiogguf.integrity._hashing import verify_model as verify_model
    from aiogguf.integrity._hashing import verify_model_sync as verify_model_sync
    from aiogguf.integrity._hashing import verify_sha256 as verify_sha256
    from aiogguf.integrity._hashing import verify_sha256_sync as verify_sha256_sync
    from aiogguf.integrity._manifest import Manifest as Manifest

_WHERE = {
    "HashProgress": "_hashing",
    "VerifyReport": "_hashing",
    "hash_model": "_hashing",
    "hash_model_llama": "_hashing",
    "hash_model_llama_sync": "_hashing",
    "hash_model_sync": "_hashing",
    "read_any_manifest": "_hashing",
    "verify_model": "_hashing",
    "verify_model_sync": "_hashing",
    "verify_sha256": "_hashing",
    "verify_sha256_sync": "_hashing",
    "Manifest": "_manifest",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'aiogguf.integrity' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"aiogguf.integrity.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
