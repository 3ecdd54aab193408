"""Models kept resident in a server and used by other processes (issue 37): attach to
one over the server's Unix socket (``attach``, ``attach_sync``), and the shareable
images the server hands out (``aiogguf.resident._share``). docs/server.md, "Attach"."""

from aiogguf.resident._attach import attach as attach
from aiogguf.resident._attach import attach_sync as attach_sync

__all__ = ["attach", "attach_sync"]
