"""The test and benchmark harness, kept out of the runtime package.

Nothing in the loader imports this package. It holds:

* ``aiogguf.testing.synth``: synthetic llama-shaped GGUF models for the demo, the tests and
  the benchmarks; written with ``gguf``, which the ``demo`` extra brings
  (``pip install 'aiogguf[demo]'``); ``aiogguf.testing.synth_cache`` keeps them on disk
  and reuses them while complete.
* ``aiogguf.testing.baselines``: this machine's own speeds for bringing a file into memory,
  the figures a load is compared with.
* ``aiogguf.testing.bench``: measured loads in fresh processes and the sweep behind
  ``aiogguf bench``.

The modules are imported by name; this one imports none of them, so that importing one
never pulls in ``gguf`` unless it needs it.
"""

__all__: list[str] = []
