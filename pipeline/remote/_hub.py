"""``hf://OWNER/REPO/FILE.gguf[@REVISION]``: a file on the Hugging Face hub, resolved by
``huggingface_hub`` (the optional extra ``remote``) to a URL that the data path reads.

The hub's own library resolves: it knows ``HF_ENDPOINT``, the token (``HF_TOKEN`` or
the one stored by ``hf auth login``), the commit a branch or tag points to, and the
file's size. The load then reads the file at that commit (a branch that moves during the
load changes nothing), with the token only for the hub's host: its redirect to the CDN
goes without it (``HttpSource``).

Names are checked before anything is asked or written: the repository id as
``huggingface_hub`` checks it (its ``validate_repo_id``), the revision as git checks a
ref name (the hub's branches and tags are git refs; ``huggingface_hub`` itself only
quotes it into the URL, and a revision becomes a file name under ``refs/`` in the
cache), and the commit the hub answers as the 40 hex digits it is (the cache's
``snapshots/<commit>`` folder). What fails is a ``LoadError``: the name is bad input.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

from aiogguf.errors import LoadError, LoadWarning

__all__ = ["HubFile", "is_digest_etag", "is_hub_name", "parse_hub_name", "resolve_hub_file"]

PREFIX = "hf://"
# A commit as the hub names it (``huggingface_hub``'s ``REGEX_COMMIT_HASH``); a small
# git-stored file's ETag (its git blob sha1) has the same form.
COMMIT_HASH = re.compile(r"[0-9a-f]{40}")
# A file in large-file storage: its ETag is its sha256.
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# What git's check-ref-format refuses in a ref name, but for ``/`` between components
# (checked apart): ``..``, ``@{``, control characters, space, ``~^:?*[\``.
_REF_REFUSED = re.compile(r"\.\.|@\{|[\x00-\x20\x7f~^:?*\[\\]")


def is_digest_etag(etag: str) -> bool:
    """Whether the hub's ETag is a digest of the file's bytes: a sha256 (large-file
    storage) or a git blob sha1."""
    return bool(SHA256_HEX.fullmatch(etag) or COMMIT_HASH.fullmatch(etag))


def is_hub_name(path: object) -> bool:
    """True for an ``hf://`` name (any case of the scheme)."""
    return isinstance(path, str) and path[: len(PREFIX)].lower() == PREFIX


@dataclass(frozen=True, slots=True)
class HubFile:
    """One file of a hub repository, as named (``revision`` None: the default branch)
    and, once resolved, where it is read (``url``, pinned to ``commit``)."""

    repo_id: str
    filename: str
    revision: str | None
    url: str = ""
    commit: str = ""
    size: int | None = None
    token: str | None = None
    etag: str | None = None  # the hub's: a large file's sha256

    @property
    def name(self) -> str:
        at = f"@{self.revision}" if self.revision else ""
        return f"{PREFIX}{self.repo_id}/{self.filename}{at}"


def parse_hub_name(path: str) -> HubFile:
    """``hf://OWNER/REPO/FILE[@REVISION]`` taken apart (the revision may hold ``/``:
    ``@refs/pr/1``). Raises ``LoadError`` for anything else: a repository id
    ``huggingface_hub`` refuses, a revision git would not take as a ref name (or
    ``huggingface_hub`` not installed: it checks the id)."""
    rest = path[len(PREFIX) :]
    name, at, revision = rest.rpartition("@") if "@" in rest else (rest, "", "")
    parts = name.split("/")
    if (
        len(parts) < 3
        or not all(parts)
        or any(p in (".", "..") for p in parts)
        or (at and not revision)
        or any(c in path for c in "\0\r\n?#")
    ):
        raise LoadError(path, None, "expected hf://OWNER/REPO/FILE.gguf[@REVISION]")
    repo_id = "/".join(parts[:2])
    _check_repo_id(path, repo_id)
    if revision:
        _check_revision(path, revision)
    return HubFile(repo_id, "/".join(parts[2:]), revision or None)


def _check_repo_id(path: str, repo_id: str) -> None:
    """``LoadError`` for a repository id ``huggingface_hub`` refuses (``--``, ``..``,
    a character outside ``[A-Za-z0-9._-]``, more than 96 characters, ``-`` or ``.`` at
    an end); its own check, so that the two agree."""
    hub = _hub_library(path)
    try:
        hub.utils.validate_repo_id(repo_id)
    except hub.utils.HFValidationError as exc:
        raise LoadError(path, None, f"not a repository id the hub allows: {exc}") from exc


def _check_revision(path: str, revision: str) -> None:
    """``LoadError`` for a revision git would not take as a ref name (git's
    check-ref-format): empty components, one starting with ``.`` or ending in ``.lock``,
    ``..``, ``@{``, control characters and ``~^:?*[\\`` or space, a trailing ``.``, or a
    component longer than a file name may be. A commit's hex digits pass."""
    parts = revision.split("/")
    if (
        revision == "@"
        or revision.endswith(".")
        or _REF_REFUSED.search(revision)
        or any(not p or p.startswith(".") or p.endswith(".lock") for p in parts)
        or any(len(p.encode()) > 255 for p in parts)
    ):
        raise LoadError(path, None, f"not a revision the hub allows: {revision!r}")


def _hub_library(path: str) -> Any:
    """The ``huggingface_hub`` module, or ``LoadError`` saying which extra brings it."""
    try:
        import huggingface_hub
        import huggingface_hub.utils
    except ImportError:
        raise LoadError(
            path, None, "hf:// names need huggingface_hub: pip install 'aiogguf[remote]'"
        ) from None
    return huggingface_hub


def resolve_hub_file(path: str) -> HubFile:
    """Blocking (one ``HEAD`` to the hub): the commit the revision points to, the size,
    the token, and the file's URL at that commit. Raises ``LoadError`` naming ``path``:
    ``huggingface_hub`` is not installed, the name is bad (``parse_hub_name``), the hub
    does not know the file (or refuses it), or it names a commit that is not 40 hex
    digits. Warns (``LoadWarning``) when its ETag is no digest: nothing checks the
    bytes then, and nothing is cached."""
    wanted = parse_hub_name(path)
    hub = _hub_library(path)
    # Read at each load, not at import: a process may set HF_ENDPOINT late (tests).
    endpoint = os.environ.get("HF_ENDPOINT") or None
    token = hub.get_token()
    url = hub.hf_hub_url(
        wanted.repo_id, wanted.filename, revision=wanted.revision, endpoint=endpoint
    )
    try:
        meta = hub.get_hf_file_metadata(url, token=token or False, endpoint=endpoint)
    except Exception as exc:  # the library's many errors, each a failed resolution
        problem = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise LoadError(path, None, f"the hub cannot resolve it: {problem}") from exc
    if not meta.commit_hash:
        raise LoadError(path, None, "the hub named no commit for it")
    if not COMMIT_HASH.fullmatch(meta.commit_hash):
        # It names a folder of the cache: ``../..`` or ``/x`` would be one outside.
        shown = repr(meta.commit_hash[:80])
        raise LoadError(path, None, f"the hub named the commit {shown}, not 40 hex digits")
    if not (meta.etag and is_digest_etag(meta.etag)):
        # A warning, not a refusal: a mirror with ETags of its own stays usable.
        shown = repr(meta.etag[:80]) if meta.etag else "(none)"
        warnings.warn(
            f"{path}: the hub's ETag {shown} is neither a sha256 nor a git sha1: the "
            "file's digest is not checked, and it is not cached",
            LoadWarning,
            stacklevel=2,
        )
    pinned = hub.hf_hub_url(
        wanted.repo_id, wanted.filename, revision=meta.commit_hash, endpoint=endpoint
    )
    return HubFile(
        wanted.repo_id,
        wanted.filename,
        wanted.revision,
        url=pinned,
        commit=meta.commit_hash,
        size=meta.size,
        token=token or None,
        etag=meta.etag,
    )
