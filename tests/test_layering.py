"""Imports run one way: CLI → API → engine → stages → io, and no stage imports another.

Walks every module of the package with ``ast`` (imports inside functions count too: a
lazy import is still a dependency) and fails on any import that points up a layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"pipeline": "aiogguf", "stages": "aiogguf.stages", "io": "aiogguf.io"}

# Lower layers never import higher ones. Leaf modules (errors, units) sit at the bottom
# with io; the records that cross stage borders sit above io and below every stage.
LAYERS: dict[str, int] = {
    "aiogguf.errors": 0,
    "aiogguf.units": 0,
    "aiogguf.fastinit": 0,
    "aiogguf.io": 0,
    "aiogguf.events": 1,
    "aiogguf.records": 1,
    "aiogguf.names": 1,
    "aiogguf.jobs": 1,
    "aiogguf.report": 1,
    "aiogguf.images": 1,
    "aiogguf.config": 1,
    "aiogguf.rehearsal": 1,
    "aiogguf.checks": 1,
    "aiogguf.manifest": 1,
    "aiogguf.llama_hash": 1,
    "aiogguf.integrity": 1,
    "aiogguf.integrity_sink": 1,
    "aiogguf.llama_check": 1,
    "aiogguf.hash_stream": 1,
    "aiogguf.model": 2,
    "aiogguf.torch_tensors": 2,
    "aiogguf.dequant": 2,
    "aiogguf.devices": 2,
    "aiogguf.stages": 3,
    "aiogguf.headers": 4,
    "aiogguf.engine": 4,
    "aiogguf.front": 4,
    "aiogguf.progress": 2,
    "aiogguf.ready": 2,
    "aiogguf.load_resources": 4,
    "aiogguf.remote": 4,
    "aiogguf.hub": 1,
    "aiogguf.hub_cache": 1,
    "aiogguf._cache_fs": 1,
    "aiogguf.api": 5,
    "aiogguf.dry_run": 5,
    "aiogguf.compat": 6,
    "aiogguf.hashing": 5,
    "aiogguf.server_policy": 6,
    "aiogguf.server_limiter": 6,
    "aiogguf.server_remote": 6,
    "aiogguf.server_requests": 6,
    "aiogguf.server_transport": 6,
    "aiogguf.server": 6,
    "aiogguf.cli": 7,
    "aiogguf.testing": 6,  # the demo and benchmark harness: above the API, below the CLI
    "aiogguf": 9,  # the package's re-exports
    "aiogguf.__main__": 9,
}
STAGE_ORDER = ["parse", "index", "plan", "allocate", "read", "upload", "validate"]


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts]
            parts = [p for p in parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _layer(module: str) -> int:
    best = max((m for m in LAYERS if module == m or module.startswith(m + ".")), key=len)
    return LAYERS[best]


def _stage(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "stages":
        return STAGE_ORDER.index(parts[2])
    return None


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known)
    return {m for m in found if m == "aiogguf" or m.startswith("aiogguf.")}


def _edges() -> list[tuple[str, str]]:
    known = _modules()
    return sorted(
        (module, target)
        for module, path in known.items()
        for target in _imports(module, path, known)
        if target != module
    )


def _backward(source: str, target: str) -> str | None:
    if _layer(target) > _layer(source):
        return f"{source} (layer {_layer(source)}) imports {target} (layer {_layer(target)})"
    a, b = _stage(source), _stage(target)
    if a is not None and b is not None and a != b:
        # A stage depends on records and protocols; the engine (and aiogguf.headers)
        # join the stages.
        return f"stage {source} imports the stage {target}"
    return None


def test_every_module_has_a_layer() -> None:
    assert all(_layer(m) >= 0 for m in _modules())
    assert all(_stage(m) is not None for m in _modules() if m.startswith("aiogguf.stages."))


def test_no_import_points_up_a_layer() -> None:
    edges = _edges()
    assert len(edges) > 100  # the walk found the package's imports
    backward = [b for s, t in edges if (b := _backward(s, t)) is not None]
    assert backward == []


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("aiogguf.io.files", "aiogguf.records"),
        ("aiogguf.model", "aiogguf.stages.allocate"),
        ("aiogguf.stages.read", "aiogguf.stages.upload"),
        ("aiogguf.stages.index", "aiogguf.stages.parse"),
        ("aiogguf.io.devices.sim", "aiogguf.config"),
    ],
)
def test_the_check_sees_a_backward_edge(source: str, target: str) -> None:
    assert _backward(source, target) is not None


def test_the_cli_uses_the_api_not_the_stages() -> None:
    """The commands reach the loader through its public API (``load``, ``inspect``,
    ``plan``), never a stage or the engine directly."""
    reaching_in = [
        f"{source} imports {target}"
        for source, target in _edges()
        if source.startswith("aiogguf.cli")
        and target.startswith(("aiogguf.stages", "aiogguf.engine"))
    ]
    assert reaching_in == []


def _classes_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, ast.ClassDef)}


def test_no_stage_imports_another_stages_class() -> None:
    """A stage depends on records and protocols (``aiogguf.jobs``, ``aiogguf.records``)
    that the engine wires, never on another stage's classes: the reader gets a piece
    sink, not the validate stage; the upload stage gets a fill function, not the reader.
    (Helper functions and constants, such as the index's layer regex, may be shared.)"""
    known = _modules()
    reaching_in: list[str] = []
    for module, path in known.items():
        if _stage(module) is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.module is None:
                continue
            target = known.get(node.module)
            if target is None or _stage(node.module) is None or node.module == module:
                continue
            reaching_in += [
                f"{module} imports class {a.name} of {node.module}"
                for a in node.names
                if a.name in _classes_of(target)
            ]
    assert reaching_in == []
