"""The load core: one load from its request to its ``Model`` (``engine``), the front that
assembles it on the load's own thread (``front``), the resources it owns (``load_resources``),
its progress, its ready tensors and its rehearsal. The core knows no wing: where a file's
bytes come from (``aiogguf.io.source.ByteSource``) and who watches them land are seams it
owns, and the wings plug into them. docs/reading-guide.md walks a load through it.
"""
