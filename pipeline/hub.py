"""``hf://OWNER/REPO/FILE.gguf[@REVISION]``: a file on the Hugging Face hub, resolved by
``huggingface_hub`` (the optional extra ``remote``) to a URL that the data path reads.

The hub's own library resolves: it knows ``HF_ENDPOINT``, the token (``HF_TOKEN`` or
the one stored by ``hf auth login``), the commit a branch or tag points to, and the
file's size. The load then reads the file at that commit (a branch that moves during the
load changes nothing), with the token only for the hub's host: its redirect to the CDN
goes without it (``HttpSource``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from aiogguf.errors import LoadError

__all__ = ["HubFile", "is_hub_name", "parse_hub_name", "resolve_hub_file"]

PREFIX = "hf://"


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
    ``@refs/pr/1``). Raises ``LoadError`` for anything else."""
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
    return HubFile("/".join(parts[:2]), "/".join(parts[2:]), revision or None)


def resolve_hub_file(path: str) -> HubFile:
    """Blocking (one ``HEAD`` to the hub): the commit the revision points to, the size,
    the token, and the file's URL at that commit. Raises ``LoadError`` naming ``path``:
    ``huggingface_hub`` is not installed, or the hub does not know the file (or refuses
    it)."""
    wanted = parse_hub_name(path)
    try:
        import huggingface_hub as hub
    except ImportError:
        raise LoadError(
            path, None, "hf:// names need huggingface_hub: pip install 'aiogguf[remote]'"
        ) from None
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
