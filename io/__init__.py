"""Low-level I/O: aligned buffers, O_DIRECT files, mappings, device backends, ggml types.

Never import this package as a top-level ``io``: it lives at ``aiogguf.io``.
"""
