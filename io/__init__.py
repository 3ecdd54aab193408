"""Low-level I/O: aligned buffers, O_DIRECT files, mappings, device backends, ggml types.

Internal: the public API is what ``aiogguf`` itself exports (``aiogguf.RootedOpener``,
``aiogguf.DeviceKind``); each module's ``__all__`` names what the rest of the package
uses, and may change. Never import this package as a top-level ``io``: it lives at
``aiogguf.io``.
"""

__all__: list[str] = []

if __name__ != "aiogguf.io":
    # The folder io/ is the package aiogguf.io; imported by its folder's name (from the
    # repository root, or by an IDE's auto-import) it would be a second copy of every
    # module, whose classes are not the package's (an ``isinstance`` or ``except`` fails).
    raise ImportError(
        f"{__name__!r} is the folder io/ of aiogguf: import it as 'aiogguf.io' "
        "(install with: pip install -e . --config-settings editable_mode=strict)"
    )
