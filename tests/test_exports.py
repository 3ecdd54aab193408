"""The public surface, checked as trio's ``test_exports`` checks its own: every name in
``aiogguf.__all__`` resolves, belongs to the package and is fully annotated; mypy sees
each of them; pyright's ``--verifytypes`` finds the installed package at least 95% typed,
in at most 50 public modules (``tests/verify_types.py``; ``.ci/run`` runs it again on the
non-editable install)."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import os
import re
import types
import typing

import pytest
import verify_types

import aiogguf

PUBLIC = sorted(aiogguf.__all__)


def test_all_names_each_public_name_once() -> None:
    assert len(set(aiogguf.__all__)) == len(aiogguf.__all__)
    missing = [name for name in aiogguf.__all__ if not hasattr(aiogguf, name)]
    assert missing == []
    # Every re-export is listed: a name imported into the package and left out of
    # ``__all__`` is one a user finds but a type checker calls private. (A wing's names,
    # imported on first use, are re-exported in the ``TYPE_CHECKING`` block.)
    source = inspect.getsource(aiogguf)
    imported = re.findall(r"^\s*from (aiogguf\.\S+) import (\w+) as \2$", source, re.M)
    assert {name for _, name in imported} == set(aiogguf.__all__)
    # The table that resolves each name at import (or on first use) names the same module
    # as the import a type checker reads.
    assert {name: module for module, name in imported} == aiogguf._EXPORTS


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_belongs_to_the_package(name: str) -> None:
    obj = getattr(aiogguf, name)
    module = getattr(obj, "__module__", None)
    assert module is not None, name
    assert module.startswith("aiogguf."), (name, module)


def _functions(name: str) -> list[tuple[str, typing.Callable[..., object]]]:
    """The callables a user calls through ``name``: the function itself, or a class's
    public methods and constructor defined in the package."""
    obj = getattr(aiogguf, name)
    if isinstance(obj, types.FunctionType):
        return [(name, obj)]
    if not isinstance(obj, type) or issubclass(obj, enum.Enum):
        return []
    found: list[tuple[str, typing.Callable[..., object]]] = []
    # A dataclass's constructor is its fields, typed on the class (some records swap
    # the generated ``__init__`` for a faster one without annotations).
    constructor = () if dataclasses.is_dataclass(obj) else ("__init__",)
    for attr, value in vars(obj).items():
        if attr.startswith("_") and attr not in (*constructor, "__aenter__", "__enter__"):
            continue
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        if isinstance(value, types.FunctionType) and value.__module__.startswith("aiogguf."):
            found.append((f"{name}.{attr}", value))
    return found


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_callable_is_annotated(name: str) -> None:
    obj = getattr(aiogguf, name)
    if dataclasses.is_dataclass(obj):
        hints = typing.get_type_hints(obj)
        assert {f.name for f in dataclasses.fields(obj)} <= set(hints), name
    for where, fn in _functions(name):
        hints = typing.get_type_hints(fn)  # resolves every annotation, or raises
        signature = inspect.signature(fn)
        unannotated = [
            p.name
            for p in signature.parameters.values()
            if p.name not in ("self", "cls") and p.name not in hints
        ]
        assert unannotated == [], f"{where}: parameters without a type: {unannotated}"
        assert "return" in hints or fn.__name__ == "__init__", f"{where}: no return type"


@pytest.mark.slow
def test_mypy_sees_every_public_name(tmp_path: os.PathLike[str]) -> None:
    from mypy import api

    code = "import aiogguf\n" + "".join(f"reveal_type(aiogguf.{name})\n" for name in PUBLIC)
    out, _, _ = api.run(["--strict", "--no-incremental", "--follow-imports=silent", "-c", code])
    revealed = re.findall(r'note: Revealed type is "(.*)"', out)
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert errors == [], out
    assert len(revealed) == len(PUBLIC), out
    assert [r for r in revealed if r == "Any"] == []


@pytest.mark.slow
def test_pyright_finds_the_installed_package_typed() -> None:
    executable = verify_types.pyright()
    if executable is None:
        if os.environ.get("CI"):
            pytest.fail("basedpyright is not installed: the dev extra brings it")
        pytest.skip("basedpyright is not installed (pip install -e '.[dev]')")
    report = verify_types.completeness(executable)
    score = report["completenessScore"]
    assert isinstance(score, (float, int))  # pyright writes a full score as 1
    assert score >= verify_types.MIN_SCORE, f"type completeness {score:.1%}"
    # Private by default: the modules pyright takes for public are the surface the
    # README documents, the CLI's commands and the test harness, not the load's insides.
    modules = report["modules"]
    assert isinstance(modules, list)
    public = sorted(str(module["name"]) for module in modules)
    assert len(public) <= verify_types.MAX_PUBLIC_MODULES, (
        f"{len(public)} public modules (at most {verify_types.MAX_PUBLIC_MODULES}): "
        f"give the private ones a leading underscore: {public}"
    )


@pytest.mark.slow
def test_pyright_resolves_every_import_of_the_repository() -> None:
    """pyright, run on the repository as the README installs it, finds every module that
    code, tests and benchmarks import (the optional CuPy and llama-cpp-python are marked
    where they are imported)."""
    executable = verify_types.pyright()
    if executable is None:
        if os.environ.get("CI"):
            pytest.fail("basedpyright is not installed: the dev extra brings it")
        pytest.skip("basedpyright is not installed (pip install -e '.[dev]')")
    unresolved = verify_types.unresolved_imports(executable, verify_types.REPOSITORY)
    assert unresolved == []
