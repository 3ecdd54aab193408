"""The README's Python runs: every block of its Python section, in order, in one
namespace, on a synthetic model, with each ``expr  # literal`` line asserting that the
expression is that literal (or has that repr, for a comment in angle brackets); and the
GPU section's block, on whatever host runs the tests (one without a GPU too)."""

from __future__ import annotations

import ast
import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

import aiogguf
from aiogguf.testing.synth import write_synthetic_model

pytest.importorskip("torch")
pytest.importorskip("gguf")
ROOT = Path(__file__).resolve().parent.parent
# ``expr  # 'llama' (why)``, ``expr  # 2``, ``expr  # <LoadMode.MMAP: 'mmap'>``
CLAIM = re.compile(r"^(\s*)(\S.*?)  # ('[^']*'|-?\d+|True|False|None|<[^>]*>)(?: \(.*\))?$")


def python_blocks(section: str = "Python") -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.DOTALL)


def with_assertions(block: str) -> tuple[str, int]:
    """The block with each claim turned into an assertion; and how many there were."""
    lines, claims = [], 0
    for line in block.splitlines():
        match = CLAIM.match(line)
        if match is not None:
            indent, expr, claim = match.groups()
            ast.parse(expr, mode="eval")  # a claim is about an expression
            got = f"repr({expr})" if claim.startswith("<") else f"({expr})"
            want = repr(claim) if claim.startswith("<") else claim
            line = f"{indent}assert {got} == {want}, {expr!r}"
            claims += 1
        lines.append(line)
    return "\n".join(lines), claims


def test_the_section_has_blocks_with_claims() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 4
    assert sum(with_assertions(b)[1] for b in blocks) >= 6


@pytest.mark.parametrize("section", ["Python", "GPUs"])
def test_every_block_runs(section: str, disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU block read ``report.uploads[0]``: an IndexError on a host without a GPU,
    where a load uploads nothing."""
    blocks = python_blocks(section)
    assert blocks
    synth = write_synthetic_model(disk_dir / "m.gguf", size_bytes="1MiB", seed=1, n_layer=2)
    monkeypatch.chdir(ROOT)  # configs/ are named relative to the repository
    # A later section's block goes on from the Python section's first, which imports it.
    namespace: dict[str, Any] = {"aiogguf": aiogguf}
    for block in blocks:
        source, _ = with_assertions(block.replace('"model.gguf"', repr(str(synth.path))))
        code = compile(source, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(code, namespace)
        if asyncio.iscoroutine(result):
            asyncio.run(result)
