"""The hub's cache on disk: where each file lives, how a cached file is found, and every
folder and file reached only from inside the cache.

**Layout.** The files are ``huggingface_hub``'s (read from its ``file_download.py``),
so that ``hf_hub_download``, ``try_to_load_from_cache`` and ``hf cache`` find them:
``HF_HUB_CACHE`` (else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), then
``models--OWNER--REPO/blobs/<etag>`` for the bytes, ``snapshots/<commit>/<file>`` a
relative link to it, ``refs/<revision>`` the commit a branch or tag named, and the
library's lock file ``.locks/models--OWNER--REPO/<etag>.lock`` (``flock``), taken while
the blob is written. A file is read from the cache when its link exists
(``find_cached``): by the commit the hub names now, or, when the hub cannot be asked,
the one ``refs`` recorded, as the library itself does offline. Every name in it was
checked first (``aiogguf.remote._hub``): a repository id as the library checks it, a revision
as git checks a ref, a commit of 40 hex digits, an ETag that is a digest.

**Links.** Whoever else can write the cache can plant a symbolic link where a folder or a file of
the cache should be: a linked partial file, ``blobs/``, ``snapshots/<commit>``,
``refs/``, ``.locks/`` or ``models--OWNER--REPO`` would make a write land wherever it
points. So every folder below the cache's own is opened from its parent's descriptor
(``openat``) with ``O_NOFOLLOW``, every file likewise (``O_EXCL`` for a new one), and
links are made, files renamed and removed relative to those descriptors (``symlinkat``,
``renameat``, ``unlinkat``), which never follow a link in the last component either.
A link found where the cache keeps a folder or a file is refused (``LoadError`` naming
it, one line): nothing is followed, so nothing outside is read or written.

The cache folder itself (``HF_HUB_CACHE``) and the folders above it are the user's
choice and are taken as given, links included. The snapshot links of the hub's layout
are made here and never followed to write; the loader reads a cached file through its
link once ``_snapshot_blob`` has checked that the link names a blob of its repository.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Self

from aiogguf.errors import LoadError
from aiogguf.remote._hub import COMMIT_HASH, HubFile, is_digest_etag, parse_hub_name

__all__ = [
    "PARTIAL_SUFFIX",
    "CacheEntry",
    "CacheFolder",
    "cache_entry",
    "find_cached",
    "hub_cache_dir",
    "refuse_link",
]

PARTIAL_SUFFIX = ".aiogguf.incomplete"

# Opens nothing but what it names: no link followed, no terminal taken, no FIFO waited on.
_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
_MAX_TEXT_BYTES = 4096


def refuse_link(path: str) -> LoadError:
    """The error for a symbolic link where the cache keeps a folder or a file."""
    return LoadError(path, None, "a symbolic link inside the hub cache: refused, not followed")


class CacheFolder:
    """One open folder of the cache: its descriptor, and ``path`` for messages.
    Closed by ``close`` (or as a context manager); double close is harmless."""

    def __init__(self, fd: int, path: str) -> None:
        self._fd = fd
        self.path = path

    @classmethod
    def open_root(cls, root: str, *, create: bool) -> CacheFolder:
        """The cache folder (made, with those above it, when ``create``). Raises
        ``OSError``: ``FileNotFoundError`` when there is none."""
        if create:
            os.makedirs(root, exist_ok=True)
        return cls(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), root)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _check_name(self, name: str) -> None:
        """One component: never a way up, across or out (the callers' names are checked
        already; this is the last line)."""
        if name in ("", ".", "..") or "/" in name or "\0" in name:
            raise LoadError(self._join(name), None, "not a name the hub cache may hold")

    def _refuse_if_link(self, name: str, exc: OSError) -> None:
        """Raise ``refuse_link`` when ``exc`` came from a link at ``name``."""
        if self.is_link(name):
            raise refuse_link(self._join(name)) from exc

    def is_link(self, name: str) -> bool:
        st = self.lstat(name)
        return st is not None and stat.S_ISLNK(st.st_mode)

    def lstat(self, name: str) -> os.stat_result | None:
        """What is at ``name`` (a link itself, not what it names); None for nothing."""
        self._check_name(name)
        try:
            return os.stat(name, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def folder(self, names: Sequence[str], *, create: bool) -> CacheFolder:
        """The folder ``names`` below this one (each component opened from its parent,
        made first when ``create``). Raises ``LoadError`` for a link on the way,
        ``OSError`` otherwise (``FileNotFoundError``: it is not there)."""
        fd, path = os.dup(self._fd), self.path
        try:
            for name in names:
                parent = CacheFolder(fd, path)
                parent._check_name(name)
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o777, dir_fd=fd)  # the umask decides, as for the hub
                flags = os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW
                try:
                    child = os.open(name, flags, dir_fd=fd)
                except OSError as exc:  # a link: ELOOP, or ENOTDIR with O_DIRECTORY
                    parent._refuse_if_link(name, exc)
                    raise
                os.close(fd)
                fd, path = child, os.path.join(path, name)
        except BaseException:
            os.close(fd)
            raise
        return CacheFolder(fd, path)

    def open_file(
        self, name: str, flags: int, mode: int = 0o644, *, only_link: bool = False
    ) -> int:
        """A descriptor of the regular file ``name`` (``flags`` as ``os.open``; with
        ``O_CREAT | O_EXCL`` a new one). ``only_link``: a file with other hard links
        is refused too (a partial file written at any offset must be the cache's
        alone). Raises ``LoadError`` for a link or anything but a regular file,
        ``OSError`` otherwise."""
        self._check_name(name)
        try:
            fd = os.open(name, flags | _NO_FOLLOW, mode, dir_fd=self._fd)
        except OSError as exc:
            if exc.errno != errno.EEXIST:  # a new file was asked for: whatever is there
                self._refuse_if_link(name, exc)
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise LoadError(self._join(name), None, "not a regular file, in the hub cache")
            if only_link and st.st_nlink != 1:
                raise LoadError(
                    self._join(name), None, "a file of the hub cache with other hard links"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_text(self, name: str) -> str | None:
        """The short text file ``name`` (a ref), None when it is not there."""
        try:
            fd = self.open_file(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return os.read(fd, _MAX_TEXT_BYTES).decode("utf-8", "replace")
        finally:
            os.close(fd)

    def write_text(self, name: str, text: str) -> None:
        """``name`` holds ``text``, all of it or none (a new file renamed over it)."""
        tmp = f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = self.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
            self.replace(tmp, name)
        except BaseException:
            self.remove(tmp)
            raise

    def symlink(self, target: str, name: str) -> None:
        """``name`` a link to ``target`` (whatever link was there replaced)."""
        self._check_name(name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._fd)
        try:
            os.symlink(target, name, dir_fd=self._fd)
        except FileExistsError:  # made meanwhile, by another process
            if self.readlink(name) != target:
                raise

    def readlink(self, name: str) -> str:
        self._check_name(name)
        return os.readlink(name, dir_fd=self._fd)

    def replace(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` within this folder (a link at either is itself
        renamed or replaced, never followed)."""
        self._check_name(src)
        self._check_name(dst)
        os.replace(src, dst, src_dir_fd=self._fd, dst_dir_fd=self._fd)

    def remove(self, name: str) -> None:
        """Remove ``name`` if it is there (a link itself, not what it names)."""
        self._check_name(name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._fd)


# --- the layout ------------------------------------------------------------------------


def hub_cache_dir() -> str:
    """The cache folder, as ``huggingface_hub.constants.HF_HUB_CACHE`` finds it (read at
    each call: a process may set the variables after importing the library)."""
    env = os.environ

    def expand(path: str) -> str:
        return os.path.expandvars(os.path.expanduser(path))

    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface",
    )
    legacy = env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(expand(home), "hub")
    return expand(env.get("HF_HUB_CACHE") or legacy)


def _folder_name(repo_id: str) -> str:
    """The repository's folder in the cache (``validate_repo_id`` keeps ``--`` out of an
    id, so no two repositories share one)."""
    return "models--" + repo_id.replace("/", "--")


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """Where one hub file at one commit lives in the cache (``etag``: its blob's name, a
    digest's hex digits; ``commit``: 40 of them)."""

    root: str
    repo_id: str
    filename: str
    commit: str
    revision: str
    etag: str

    @property
    def folder_name(self) -> str:
        return _folder_name(self.repo_id)

    @property
    def partial_name(self) -> str:
        return self.etag + PARTIAL_SUFFIX

    @property
    def lock_name(self) -> str:
        return self.etag + ".lock"

    def link(self, storage: CacheFolder | None = None) -> None:
        """The snapshot's link to the blob (relative, as the library makes it), and the
        revision's ref when it named a branch or tag; ``storage``: the repository's
        folder, open (else opened here). Raises ``OSError``, or ``LoadError`` for a
        link planted on the way."""
        if storage is None:
            with (
                CacheFolder.open_root(self.root, create=False) as root,
                root.folder([self.folder_name], create=False) as opened,
            ):
                self.link(opened)
            return
        *dirs, base = self.filename.split("/")
        with storage.folder(["snapshots", self.commit, *dirs], create=True) as folder:
            folder.symlink("../" * (len(dirs) + 2) + "blobs/" + self.etag, base)
        if self.revision != self.commit:
            *dirs, base = self.revision.split("/")
            with storage.folder(["refs", *dirs], create=True) as refs:
                if refs.read_text(base) != self.commit:
                    refs.write_text(base, self.commit)


def cache_entry(found: HubFile) -> CacheEntry | None:
    """The cache entry of a resolved hub file; None without an ETag that is a digest
    (only a verified file is cached) or a commit of 40 hex digits."""
    if found.etag is None or not is_digest_etag(found.etag):
        return None
    if not COMMIT_HASH.fullmatch(found.commit):
        return None
    revision = found.revision or "main"
    return CacheEntry(
        hub_cache_dir(), found.repo_id, found.filename, found.commit, revision, found.etag
    )


def find_cached(path: str, resolve: Callable[[str], HubFile]) -> tuple[str | None, HubFile | None]:
    """``(local file, resolution)`` for the ``hf://`` name ``path``: the cached file
    (every split of a split set named by its first) at the commit ``resolve(path)``
    names; at a pinned commit, no question to the hub; when the hub cannot be asked (not
    when it says no), the commit ``refs`` recorded. A blob already cached for another
    commit is linked. Raises what ``resolve`` raises when nothing cached stands in, and
    ``LoadError`` for a link planted in the cache."""
    wanted = parse_hub_name(path)
    root = hub_cache_dir()
    if wanted.revision and COMMIT_HASH.fullmatch(wanted.revision):
        local = _snapshot_file(root, wanted.repo_id, wanted.revision, wanted.filename)
        if local is not None:
            return local, None
    try:
        found = resolve(path)
    except LoadError as exc:
        if _hub_said_no(exc.__cause__):
            raise
        commit = _read_ref(root, wanted.repo_id, wanted.revision or "main")
        local = None
        if commit is not None and COMMIT_HASH.fullmatch(commit):
            local = _snapshot_file(root, wanted.repo_id, commit, wanted.filename)
        if local is None:
            raise
        return local, None
    local = _snapshot_file(root, found.repo_id, found.commit, found.filename)
    entry = cache_entry(found)
    single = _split_count(found.filename) == 1
    if local is None and entry is not None and single and _blob_size(entry) == found.size:
        with contextlib.suppress(OSError):
            entry.link()  # the same bytes at another commit
        local = _snapshot_file(root, found.repo_id, found.commit, found.filename)
    return local, found


def _split_count(filename: str) -> int:
    match = re.search(r"-(\d{5})-of-(\d{5})\.gguf$", filename)
    return int(match.group(2)) if match else 1


def _read_ref(root: str, repo_id: str, revision: str) -> str | None:
    """The commit ``refs/<revision>`` recorded, if any."""
    *dirs, base = revision.split("/")
    try:
        with (
            CacheFolder.open_root(root, create=False) as top,
            top.folder([_folder_name(repo_id), "refs", *dirs], create=False) as refs,
        ):
            text = refs.read_text(base)
    except OSError:
        return None
    return text.strip() if text is not None else None


def _blob_size(entry: CacheEntry) -> int | None:
    """The size of the entry's blob, if the cache has it (a regular file)."""
    try:
        with (
            CacheFolder.open_root(entry.root, create=False) as top,
            top.folder([entry.folder_name, "blobs"], create=False) as blobs,
        ):
            st = blobs.lstat(entry.etag)
    except OSError:
        return None
    return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else None


def _snapshot_file(root: str, repo_id: str, commit: str, filename: str) -> str | None:
    """The cached file at ``commit``; for a first split, only when every split is there."""
    count = _split_count(filename)
    names = [filename]
    if count > 1 and filename.endswith(f"-00001-of-{count:05d}.gguf"):
        stem = filename[: -len(f"-00001-of-{count:05d}.gguf")]
        names = [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    try:
        with (
            CacheFolder.open_root(root, create=False) as top,
            top.folder([_folder_name(repo_id)], create=False) as storage,
        ):
            if not all(_snapshot_blob(storage, commit, name) for name in names):
                return None
    except OSError:
        return None
    return os.path.join(root, _folder_name(repo_id), "snapshots", commit, *filename.split("/"))


def _snapshot_blob(storage: CacheFolder, commit: str, filename: str) -> bool:
    """Whether ``snapshots/<commit>/<filename>`` is a regular file, or the library's
    relative link to a regular file in ``blobs/``. Raises ``OSError`` (not there), and
    ``LoadError`` for a link on the way or one that leads anywhere else."""
    *dirs, base = filename.split("/")
    with storage.folder(["snapshots", commit, *dirs], create=False) as folder:
        st = folder.lstat(base)
        if st is None or not stat.S_ISLNK(st.st_mode):
            return st is not None and stat.S_ISREG(st.st_mode)  # a cache made without links
        target = folder.readlink(base)
        prefix = "../" * (len(dirs) + 2) + "blobs/"
        blob = target[len(prefix) :]
        if not target.startswith(prefix) or "/" in blob or blob in ("", ".", ".."):
            raise LoadError(
                os.path.join(folder.path, base),
                None,
                f"a link to {target[:200]!r}, not to a blob of its repository: refused",
            )
    with storage.folder(["blobs"], create=False) as blobs:
        st = blobs.lstat(blob)
    return st is not None and stat.S_ISREG(st.st_mode)


def _hub_said_no(cause: BaseException | None) -> bool:
    """Whether the hub answered (a 4xx: no such repository, revision or file, or no
    access), as against not being reachable, which the cache may stand in for."""
    response = getattr(cause, "response", None)
    status = getattr(response, "status_code", None)
    return isinstance(status, int) and 400 <= status < 500
