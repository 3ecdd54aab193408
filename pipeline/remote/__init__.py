"""Remote sources: a model read over HTTP(S) by byte ranges (``_http_source``), hub names
resolved by ``huggingface_hub`` (``_hub``) and the hub's own cache written as a load
streams (``_hub_cache``, ``_cache_fs``); the addresses they may reach are
``aiogguf._addresses``' (a server's settings name them too). A load of a URL or an
``hf://`` name gets them through the core's byte-source seam. docs/remote.md."""

__all__: list[str] = []
