"""Shared fixtures. ``reference_dir`` is llama.cpp's own files in ../shared/testdata:
missing on a developer's machine they skip, missing under CI they fail."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_DIR = ROOT.parent / "shared" / "testdata" / "reference"


def _require_reference() -> Path:
    if (REFERENCE_DIR / "MANIFEST.json").is_file():
        return REFERENCE_DIR
    message = f"reference GGUF files not found at {REFERENCE_DIR}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message + " (CI=true: they must be there)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    return _require_reference()


@pytest.fixture(scope="session")
def manifest(reference_dir: Path) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = json.loads((reference_dir / "MANIFEST.json").read_text())
    return data


def reference_files() -> list[str]:
    """Names of the reference .gguf files, for parametrising (empty if absent)."""
    if not REFERENCE_DIR.is_dir():
        return ["<missing>"]
    return sorted(p.name for p in REFERENCE_DIR.glob("*.gguf"))
