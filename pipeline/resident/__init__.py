"""Models kept resident in a server and used by other processes without a copy: attach
to one over the server's Unix socket (``attach``, ``attach_sync``). A model loaded with
``[load] shareable = true`` is described and its memory's descriptors gathered by
``share_model``; another process opens it with ``open_shared_model`` (the descriptors
travel over the socket with ``SCM_RIGHTS``). docs/server.md, "Attach" and "Shareable
images"."""

from aiogguf.resident._attach import attach as attach
from aiogguf.resident._attach import attach_sync as attach_sync
from aiogguf.resident._share import ModelShare as ModelShare
from aiogguf.resident._share import open_shared_model as open_shared_model
from aiogguf.resident._share import share_model as share_model

__all__ = ["ModelShare", "attach", "attach_sync", "open_shared_model", "share_model"]
