"""The stages of a load, one module each: parse, index, plan, allocate, read, upload,
validate.

Internal: the public API is what ``aiogguf`` itself exports (``aiogguf.inspect`` and
``aiogguf.plan`` run the first three stages); each module's ``__all__`` names what the
rest of the package uses, and may change.
"""

__all__: list[str] = []

if __name__ != "aiogguf.stages":
    # The folder stages/ is the package aiogguf.stages; imported by its folder's name (from the
    # repository root, or by an IDE's auto-import) it would be a second copy of every
    # module, whose classes are not the package's (an ``isinstance`` or ``except`` fails).
    raise ImportError(
        f"{__name__!r} is the folder stages/ of aiogguf: import it as 'aiogguf.stages' "
        "(install with: pip install -e . --config-settings editable_mode=strict)"
    )
