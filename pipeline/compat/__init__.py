"""Interoperation with gguf-py (the ``gguf`` extra): ``GGUFReader``, a drop-in for
gguf-py's reader whose bytes aiogguf loads, so that code written against gguf-py (and
gguf-py's own scripts) runs unchanged. docs/python.md."""

from aiogguf.compat._reader import CompatFileNotFoundError as CompatFileNotFoundError
from aiogguf.compat._reader import CompatFormatError as CompatFormatError
from aiogguf.compat._reader import CompatIsADirectoryError as CompatIsADirectoryError
from aiogguf.compat._reader import CompatOSError as CompatOSError
from aiogguf.compat._reader import CompatPermissionError as CompatPermissionError
from aiogguf.compat._reader import GGUFReader as GGUFReader
from aiogguf.compat._reader import ReaderField as ReaderField
from aiogguf.compat._reader import ReaderTensor as ReaderTensor

__all__ = [
    "CompatFileNotFoundError",
    "CompatFormatError",
    "CompatIsADirectoryError",
    "CompatOSError",
    "CompatPermissionError",
    "GGUFReader",
    "ReaderField",
    "ReaderTensor",
]
