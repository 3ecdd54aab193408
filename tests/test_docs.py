"""Every "design §x" and "format §x" cited in the code resolves to a section of
docs/design.md or docs/format.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = {"design": ROOT / "docs" / "design.md", "format": ROOT / "docs" / "format.md"}
SOURCES = ("pipeline", "stages", "io", "tests", "bench")
HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", re.MULTILINE)
# "design §1.3", "format §5.1", or a bare "§2.4" that refers to the document named last.
CITATION = re.compile(r"(?:\b(design|format|gguf-format) )?§ ?(\d+(?:\.\d+)*)")


def sections(doc: Path) -> set[str]:
    return set(HEADING.findall(doc.read_text(encoding="utf-8")))


def citations(text: str) -> list[tuple[str | None, str]]:
    """(document, section) for every § in ``text``; a bare § takes the document named
    before it in the same text (None when there is none)."""
    found: list[tuple[str | None, str]] = []
    current: str | None = None
    for match in CITATION.finditer(text):
        if match.group(1) is not None:
            current = match.group(1)
        found.append((current, match.group(2)))
    return found


def cited_in_code() -> list[tuple[str, str, str]]:
    cited: list[tuple[str, str, str]] = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue  # this file's examples are not citations
            for doc, section in citations(path.read_text(encoding="utf-8")):
                cited.append((str(path.relative_to(ROOT)), doc or "?", section))
    return cited


def test_the_citation_walk_sees_every_form() -> None:
    text = "(design §1.3, §2.1) then format §1.5.2, §1.6 and (§3.2)"
    assert citations(text) == [
        ("design", "1.3"),
        ("design", "2.1"),
        ("format", "1.5.2"),
        ("format", "1.6"),
        ("format", "3.2"),
    ]


def test_the_code_cites_both_documents() -> None:
    docs = {doc for _, doc, _ in cited_in_code()}
    assert docs == {"design", "format"}


@pytest.mark.parametrize(("where", "doc", "section"), cited_in_code())
def test_every_citation_resolves(where: str, doc: str, section: str) -> None:
    assert doc in DOCS, f"{where}: §{section} names no document (or the old 'gguf-format')"
    assert section in sections(DOCS[doc]), f"{where}: {doc} §{section} is not a section"


def test_design_cites_only_sections_of_format() -> None:
    text = DOCS["design"].read_text(encoding="utf-8")
    cited = {section for doc, section in citations(text) if doc == "format"}
    assert cited, "design.md cites format.md"
    assert cited <= sections(DOCS["format"])
