"""Models kept resident and shared with other processes without a copy: a model loaded
with ``[load] shareable = true`` is described and its memory's descriptors gathered by
``share_model``; another process opens it with ``open_shared_model`` (the descriptors
travel over a Unix socket with ``SCM_RIGHTS``). docs/server.md, "Shareable images"."""

from aiogguf.resident._share import ModelShare as ModelShare
from aiogguf.resident._share import open_shared_model as open_shared_model
from aiogguf.resident._share import share_model as share_model

__all__ = ["ModelShare", "open_shared_model", "share_model"]
