"""Imports run one way: CLI → API → core → wings that plug into it → stages → records →
io, and no stage imports another.

Walks every module of the package with ``ast`` (imports inside functions count too: a
lazy import is still a dependency) and fails on any import that points up a layer. The
table is by folder and kind, not by module: a new module takes its folder's layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"pipeline": "aiogguf", "stages": "aiogguf.stages", "io": "aiogguf.io"}

# Lower layers never import higher ones (the longest prefix names a module's layer).
LAYERS: dict[str, int] = {
    # Leaves: the error tree, units, the address vocabulary, the loop runner, and io.
    "aiogguf.errors": 0,
    "aiogguf._units": 0,
    "aiogguf._fastinit": 0,
    "aiogguf._addresses": 0,
    "aiogguf._run": 0,
    "aiogguf.io": 0,
    # Records that cross stage borders, and the config.
    "aiogguf._records": 1,
    "aiogguf._names": 1,
    "aiogguf._jobs": 1,
    "aiogguf._images": 1,
    "aiogguf._config": 1,
    "aiogguf._checks": 1,
    "aiogguf._events": 1,
    "aiogguf._report": 1,
    # What a loaded model hands out, and the devices a load finds.
    "aiogguf._model": 2,
    "aiogguf._torch": 2,
    "aiogguf._dequant": 2,
    "aiogguf._devices": 2,
    "aiogguf.stages": 3,
    # Wings that plug into the core's seams: byte sources and watchers.
    "aiogguf.remote": 4,
    "aiogguf.integrity": 4,
    "aiogguf._core": 5,
    # The API, and the integrity wing's public calls, which run the core's header parse.
    "aiogguf._api": 6,
    "aiogguf._dry_run": 6,
    "aiogguf._local_index": 6,
    "aiogguf.integrity._hashing": 6,
    # Wings that are clients of the API.
    "aiogguf.compat": 7,
    # Resident models: shareable images handed to another process, the attach client
    # (above the API: it opens a Model) and its protocol (``server`` uses them).
    "aiogguf.resident": 7,
    "aiogguf.server": 7,
    "aiogguf.cluster": 7,  # loads over a Ray cluster: each node's loader runs the API's load
    "aiogguf.testing": 7,  # the demo and benchmark harness: above the API, below the CLI
    "aiogguf.cli": 8,
    "aiogguf": 9,  # the package's re-exports
    "aiogguf.__main__": 9,
}
# A wing's ``__init__`` re-exports its public calls (on first use): it sits with them.
INIT_LAYERS: dict[str, int] = {"aiogguf.integrity": 6}
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
    if module in INIT_LAYERS:
        return INIT_LAYERS[module]
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
        # A stage depends on records and protocols; the engine (and aiogguf._core.assemble)
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
        ("aiogguf.io.files", "aiogguf._records"),
        ("aiogguf._model", "aiogguf.stages.allocate"),
        ("aiogguf.stages.read", "aiogguf.stages.upload"),
        ("aiogguf.stages.index", "aiogguf.stages.parse"),
        ("aiogguf.io._devices.sim", "aiogguf._config"),
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
        and target.startswith(("aiogguf.stages", "aiogguf._core.engine"))
    ]
    assert reaching_in == []


def _classes_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, ast.ClassDef)}


def test_no_stage_imports_another_stages_class() -> None:
    """A stage depends on records and protocols (``aiogguf._jobs``, ``aiogguf._records``)
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


WINGS = (
    "aiogguf.integrity",
    "aiogguf.remote",
    "aiogguf.server",
    "aiogguf.compat",
    "aiogguf.resident",
    "aiogguf.cluster",
)
ASSEMBLER = "aiogguf._core.assemble"


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_core_imports_wings_only_through_the_assembler() -> None:
    """The load core knows no wing: where bytes come from and who watches them land are
    its seams, and only the assembler, which builds them for a load, imports a wing."""
    reaching_out = [
        f"{source} imports {target}"
        for source, target in _edges()
        if _in(source, ("aiogguf._core",)) and source != ASSEMBLER and _in(target, WINGS)
    ]
    assert reaching_out == []
    # The rule sees such an import: the assembler has them.
    assert any(s == ASSEMBLER and _in(t, WINGS) for s, t in _edges())


def test_stages_never_import_the_core_the_api_or_a_wing() -> None:
    """A stage does one job on records; the core joins the stages, the API and the
    wings sit above them."""
    above = ("aiogguf._core", "aiogguf._api", "aiogguf._dry_run", "aiogguf.cli", *WINGS)
    reaching_up = [
        f"{source} imports {target}"
        for source, target in _edges()
        if _in(source, ("aiogguf.stages",)) and (_in(target, above) or target == "aiogguf")
    ]
    assert reaching_up == []
