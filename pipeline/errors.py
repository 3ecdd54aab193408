"""The aiogguf error tree.

Every error a user can see from aiogguf is one of these::

    GGUFError                      base: anything aiogguf refuses or fails at
    ├── GGUFFormatError            a malformed file: path, byte offset, field, what was expected
    ├── SplitError                 split sets: wrong first file, missing shard, foreign shard
    ├── PlacementError             the plan cannot be made (bad main_gpu, no split buffer type…)
    ├── ConfigError                a config key that is unknown, mistyped or out of range
    ├── LoadError                  I/O failed or came up short: path and offset
    │   ├── BigEndianError         a big-endian tensor whose type cannot be byte-swapped
    │   ├── PathNotAllowedError    a file outside the roots a loader may read (a server's)
    │   └── AttachError            attaching to a server's resident model failed: socket, model
    ├── ManifestError              a hash manifest that cannot be used: path, field, expected
    │   └── ManifestMismatchError  a manifest of another model or file (says why)
    └── TensorValidationError      every bad tensor of a load, at once (``.failures``)
        └── IntegrityError         bytes that differ from a hash manifest (file, block, offset)

    ClosedResourceError            a model, buffer, file or mapping used after close():
                                   a bug in the caller, so a ValueError, not a GGUFError

``aiogguf.compat._reader.GGUFReader`` alone raises its own subclasses of these, which are also
what gguf-py's reader raises: ``CompatFormatError`` (a ``GGUFFormatError`` and a
``ValueError``), ``CompatOSError`` (a ``LoadError`` and an ``OSError``) and its
``FileNotFoundError``, ``PermissionError`` and ``IsADirectoryError`` kinds.

Low-level errors are translated where they happen, with ``raise ... from exc``, where
the path and offset are known: every ``OSError`` through ``os_errors``, the one place
that words it (``struct.error`` and CuPy's errors at their own call sites). The engine
is the boundary behind them: an ``OSError`` that still escapes a stage becomes a
``LoadError`` naming the model there. What does not stop a load is a ``LoadWarning``
(a ``UserWarning``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AttachError",
    "BigEndianError",
    "ClosedResourceError",
    "ConfigError",
    "GGUFError",
    "GGUFFormatError",
    "IntegrityError",
    "LoadError",
    "LoadWarning",
    "ManifestError",
    "ManifestMismatchError",
    "PathNotAllowedError",
    "PlacementError",
    "SplitError",
    "TensorFailure",
    "TensorValidationError",
    "from_os_error",
    "os_errors",
    "shown_path",
]


def shown_path(path: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> str:
    """``path`` as a message shows it: every character that is not printable (control
    characters, line separators, the surrogates of undecodable bytes) escaped as
    ``repr`` escapes it, without the quotes, so that a file's name can neither break a
    message's line nor drive a terminal; the rest as is."""
    return _shown(os.fsdecode(path))


def _shown(text: str) -> str:
    # The errors' message builders pass their other parts through this too: a problem
    # names other files (a split's siblings) and a file's own strings (tensor names).
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _where(path: str | os.PathLike[str] | None) -> str:
    return f"{shown_path(path)}: " if path is not None else ""


class GGUFError(Exception):
    """Base of every error aiogguf raises on purpose."""


class GGUFFormatError(GGUFError):
    """The file is not a valid GGUF file; names the byte offset and the field."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        offset: int | None,
        field: str,
        problem: str,
    ) -> None:
        self.path: str | None = os.fspath(path) if path is not None else None
        self.offset = offset
        self.field = field
        self.problem = problem
        at = f"at offset {offset}: " if offset is not None else ""
        super().__init__(f"{_where(path)}{at}{_shown(field)}: {_shown(problem)}")


class SplitError(GGUFError):
    """A split (sharded) model is incomplete, out of order, or mixed with another one."""

    def __init__(self, path: str | os.PathLike[str] | None, problem: str) -> None:
        self.path: str | None = os.fspath(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{_where(path)}{_shown(problem)}")


class PlacementError(GGUFError):
    """The placement rules cannot be satisfied with these devices and settings."""

    def __init__(self, message: str) -> None:
        super().__init__(_shown(message))  # it names tensors, whose names a file gives


class ConfigError(GGUFError):
    """A configuration value is unknown, of the wrong type, or out of range."""

    def __init__(self, key: str, source: str | None, problem: str) -> None:
        self.key = key
        self.source = source
        self.problem = problem
        where = f"{shown_path(source)}: " if source else ""
        super().__init__(f"{where}{_shown(key)}: {_shown(problem)}")


class LoadError(GGUFError):
    """Reading tensor data failed: names the file and the byte offset."""

    def __init__(
        self, path: str | os.PathLike[str] | None, offset: int | None, problem: str
    ) -> None:
        self.path: str | None = os.fspath(path) if path is not None else None
        self.offset = offset
        self.problem = problem
        at = f"at offset {offset}: " if offset is not None else ""
        super().__init__(f"{_where(path)}{at}{_shown(problem)}")


def from_os_error(
    exc: OSError, path: str | os.PathLike[str] | None, offset: int | None, doing: str
) -> LoadError:
    """The ``LoadError`` an ``OSError`` becomes: ``"<doing>: <why>"`` at ``path`` and
    ``offset``. Raise it ``from exc`` (its ``errno`` stays reachable as ``__cause__``)."""
    return LoadError(path, offset, f"{doing}: {exc.strerror or exc}")


@contextmanager
def os_errors(
    path: str | os.PathLike[str] | None, offset: int | None, doing: str
) -> Iterator[None]:
    """``with os_errors(path, offset, "cannot open"): ...``: an ``OSError`` inside
    leaves as ``from_os_error(...)``, the one wording of every I/O failure."""
    try:
        yield
    except OSError as exc:
        raise from_os_error(exc, path, offset, doing) from exc


class BigEndianError(LoadError):
    """A big-endian file holds a tensor type whose byte order cannot be converted."""


class PathNotAllowedError(LoadError):
    """A path lies outside every root the loader may read, or a symlink leads out of one;
    a remote name or address a server may not reach (``problem`` says which).

    Says nothing about the file itself (whether it exists, its size, its bytes): only the
    path as it was asked for."""

    def __init__(
        self, path: str | os.PathLike[str], problem: str = "not under a served root"
    ) -> None:
        super().__init__(path, None, problem)


class AttachError(LoadError):
    """Attaching to a model resident in a server failed (``aiogguf.attach``): the server's
    socket, the model asked for, and why (refused, unknown, unloaded, the peer broke the
    protocol). ``path`` is the socket's."""

    def __init__(
        self, socket_path: str | os.PathLike[str], model: str | None, problem: str
    ) -> None:
        self.model = model
        what = f"model {_shown(model)}: " if model else ""
        super().__init__(socket_path, None, f"{what}{problem}")


@dataclass(frozen=True, slots=True)
class TensorFailure:
    """One bad tensor: what is wrong and where the first bad block or element is."""

    name: str
    type_name: str
    problem: str
    first_index: int | None
    count: int

    def __str__(self) -> str:
        if self.first_index is None and not self.count:
            # A whole-tensor failure (invalid type, bad size): no index, nothing counted.
            return f"tensor '{_shown(self.name)}' ({self.type_name}): {self.problem}"
        at = f" (first at index {self.first_index}" if self.first_index is not None else " ("
        sep = ", " if self.first_index is not None else ""
        name = _shown(self.name)
        return f"tensor '{name}' ({self.type_name}): {self.problem}{at}{sep}{self.count} bad)"


class TensorValidationError(GGUFError):
    """Tensors with invalid data were found; ``failures`` lists every one of them."""

    def __init__(self, failures: Sequence[TensorFailure], path: str | None = None) -> None:
        self.failures: tuple[TensorFailure, ...] = tuple(failures)
        self.path = path
        lines = "\n".join(f"  {failure}" for failure in self.failures)
        n = len(self.failures)
        noun = "tensor" if n == 1 else "tensors"
        super().__init__(f"{_where(path)}found {n} {noun} with invalid data:\n{lines}")


class IntegrityError(TensorValidationError):
    """Bytes of the model differ from its hash manifest: ``failures`` names every bad
    tensor, each with the file, the block and its offset."""

    def __init__(
        self, failures: Sequence[TensorFailure], path: str | None = None, summary: str = ""
    ) -> None:
        """``summary``: the message, where no tensor is to blame (a whole file's sha256)."""
        super().__init__(failures, path)
        self.args: tuple[Any, ...] = (
            f"{_where(path)}{_shown(summary)}" if summary else self._one_line(path),
        )

    def _one_line(self, path: str | None) -> str:
        # One line, whatever the count: a command prints it as is.
        n = len(self.failures)
        noun = "tensor differs" if n == 1 else "tensors differ"
        shown = "; ".join(str(f) for f in self.failures[:3])
        more = f"; and {n - 3} more" if n > 3 else ""
        return f"{_where(path)}{n} {noun} from the manifest: {_shown(shown)}{more}"


class ManifestError(GGUFError):
    """A hash manifest that cannot be used: malformed, too large, or of an unknown
    version. Names the manifest, the field and what was expected there."""

    def __init__(self, path: str | os.PathLike[str] | None, field: str, problem: str) -> None:
        self.path: str | None = os.fspath(path) if path is not None else None
        self.field = field
        self.problem = problem
        where = f"{_shown(field)}: " if field else ""
        super().__init__(f"{_where(path)}{where}{_shown(problem)}")


class ManifestMismatchError(ManifestError):
    """A well-formed manifest that describes another model or file (other sizes, other
    tensors, another header): refused before any byte is compared."""


class LoadWarning(UserWarning):
    """Something about a load the user should know, that does not stop it: a fallback
    (O_DIRECT refused, mode ``none`` instead), a limit too low (``RLIMIT_MEMLOCK``)."""


class ClosedResourceError(ValueError):
    """A model, buffer, file or mapping was used after ``close()``: a bug in the caller,
    not a bad file. A ``ValueError`` like Python's own "I/O operation on closed file"."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"{what} is closed")
